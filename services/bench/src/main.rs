//! `reelay-bench`: how fast Reelay is, against the limits of this machine, measured in one run.
//!
//! Every scenario starts what it measures (real `reelay` processes, a pinned `nats-server`) and
//! reports a baseline measured in the same run, because these machines are shared and noisy:
//! absolute numbers move, ratios hold. Run it with `scripts/bench` (release build); it prints one
//! table and writes `bench-results.json`.

mod enrichment;
mod images;
mod many;
mod report;
mod scenarios;

use std::path::PathBuf;
use std::time::Duration;

use crate::report::Report;

/// Shared settings of a run.
pub struct Bench {
    /// The `reelay` binary (built with the `bench` feature: probes and the `skip_events` hook).
    pub reelay: String,
    /// How long each measured phase runs.
    pub measure: Duration,
    pub warmup: Duration,
    pub relay_backlog: usize,
    /// Posters converted per line of the images scenario.
    pub posters: usize,
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .map_or_else(|| PathBuf::from("bench-results.json"), PathBuf::from);
    let only: Vec<String> = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    let reelay = std::env::current_exe()?.with_file_name("reelay");
    anyhow::ensure!(reelay.exists(), "no reelay binary next to the bench at {}; run scripts/bench", reelay.display());
    let bench = Bench {
        reelay: reelay.to_string_lossy().into_owned(),
        measure: if quick { Duration::from_secs(2) } else { Duration::from_secs(5) },
        warmup: if quick { Duration::from_millis(300) } else { Duration::from_secs(1) },
        relay_backlog: if quick { 20_000 } else { 100_000 },
        posters: if quick { 3 } else { 10 },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = runtime.block_on(async {
        let mut report = Report::default();
        // Runs a scenario when it is wanted and says how long it took.
        macro_rules! scenario {
            ($name:literal, $run:expr) => {
                if only.is_empty() || only.iter().any(|o| o == $name) {
                    let started = std::time::Instant::now();
                    $run(&bench, &mut report).await?;
                    eprintln!("({} took {:.0} s)", $name, started.elapsed().as_secs_f64());
                }
            };
        }
        scenario!("write", scenarios::write_path);
        scenario!("relay", scenarios::relay_drain);
        scenario!("latency", scenarios::latency);
        scenario!("ledger", scenarios::ledger);
        scenario!("e2e", scenarios::sustained);
        scenario!("many", many::many_handlers);
        scenario!("replicas", many::replicas);
        scenario!("enrichment", enrichment::enrichment_and_wrap_up);
        scenario!("images", images::conversion);
        anyhow::Ok(report)
    })?;
    report.print();
    report.write_json(&out)?;
    eprintln!("results written to {}", out.display());
    Ok(())
}
