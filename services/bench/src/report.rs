//! The result table and its JSON form.

use std::path::Path;

/// One measured figure with the baseline it is compared against.
pub struct Line {
    pub scenario: String,
    pub measured: f64,
    pub unit: &'static str,
    pub baseline: Option<(String, f64)>,
    /// What the figure must reach, as text, and whether it did.
    pub target: Option<(String, bool)>,
}

#[derive(Default)]
pub struct Report {
    pub lines: Vec<Line>,
}

impl Report {
    pub fn add(&mut self, scenario: impl Into<String>, measured: f64, unit: &'static str) -> &mut Line {
        self.lines.push(Line { scenario: scenario.into(), measured, unit, baseline: None, target: None });
        let line = self.lines.last_mut().expect("just pushed");
        eprintln!("  {:<58} {:>12.1} {}", line.scenario, measured, unit);
        line
    }

    pub fn print(&self) {
        println!();
        let header = ["scenario", "measured", "unit", "baseline (same run)", "ratio", "target"];
        println!(
            "{:<58} {:>12} {:<6} {:<40} {:>8}  {}",
            header[0], header[1], header[2], header[3], header[4], header[5]
        );
        for l in &self.lines {
            let (baseline, ratio) = match &l.baseline {
                Some((name, value)) => (format!("{name}: {value:.1}"), format!("{:.2}x", l.measured / value)),
                None => (String::new(), String::new()),
            };
            let target = match &l.target {
                Some((text, met)) => format!("{text} {}", if *met { "met" } else { "MISSED" }),
                None => String::new(),
            };
            println!("{:<58} {:>12.1} {:<6} {:<40} {:>8}  {}", l.scenario, l.measured, l.unit, baseline, ratio, target);
        }
    }

    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let lines: Vec<serde_json::Value> = self
            .lines
            .iter()
            .map(|l| {
                serde_json::json!({
                    "scenario": l.scenario,
                    "measured": l.measured,
                    "unit": l.unit,
                    "baseline": l.baseline.as_ref().map(|(n, v)| serde_json::json!({"name": n, "value": v})),
                    "ratio": l.baseline.as_ref().map(|(_, v)| l.measured / v),
                    "target": l.target.as_ref().map(|(t, met)| serde_json::json!({"text": t, "met": met})),
                })
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&serde_json::json!({ "results": lines }))? + "\n")
    }
}

impl Line {
    pub fn against(&mut self, name: impl Into<String>, value: f64) -> &mut Self {
        self.baseline = Some((name.into(), value));
        self
    }

    /// A target on the ratio to the baseline.
    pub fn ratio_at_least(&mut self, minimum: f64) -> &mut Self {
        let met = self.baseline.as_ref().is_some_and(|(_, v)| self.measured / v >= minimum);
        self.target = Some((format!(">= {minimum}x"), met));
        self
    }

    /// A ceiling on the ratio to the baseline.
    pub fn ratio_at_most(&mut self, maximum: f64) -> &mut Self {
        let met = self.baseline.as_ref().is_some_and(|(_, v)| self.measured / v <= maximum);
        self.target = Some((format!("<= {maximum}x"), met));
        self
    }

    pub fn at_most(&mut self, maximum: f64) -> &mut Self {
        self.target = Some((format!("<= {maximum} {}", self.unit), self.measured <= maximum));
        self
    }
}
