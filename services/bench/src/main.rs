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

/// The scenarios, in the order a run takes them.
const SCENARIOS: [&str; 9] = ["write", "relay", "latency", "ledger", "e2e", "many", "replicas", "enrichment", "images"];

const USAGE: &str = "\
usage: reelay-bench [--quick] [--only SCENARIO,...] [--out FILE]

  --quick   shorter phases, a 20,000-row relay backlog
  --only    run only these scenarios (comma-separated): write, relay, latency, ledger, e2e,
            many, replicas, enrichment, images
  --out     where to write the results as JSON (default: bench-results.json)

Run it through scripts/bench, which builds it with the probes it needs.";

/// What the command line asked for.
struct Args {
    quick: bool,
    /// Empty: every scenario.
    only: Vec<String>,
    out: PathBuf,
}

/// Reads the command line; `Err` holds what to print (the usage, after what was wrong).
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args { quick: false, only: Vec::new(), out: PathBuf::from("bench-results.json") };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => parsed.quick = true,
            "--only" => {
                let list = args.next().ok_or("--only needs a list of scenarios")?;
                for name in list.split(',').filter(|n| !n.is_empty()) {
                    if !SCENARIOS.contains(&name) {
                        return Err(format!("unknown scenario {name:?}"));
                    }
                    parsed.only.push(name.to_owned());
                }
                if parsed.only.is_empty() {
                    return Err("--only needs a list of scenarios".into());
                }
            }
            "--out" => parsed.out = args.next().ok_or("--out needs a file name")?.into(),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(parsed)
}

fn main() -> anyhow::Result<()> {
    let Args { quick, only, out } = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(problem) if problem.is_empty() => {
            println!("{USAGE}");
            return Ok(());
        }
        Err(problem) => {
            eprintln!("reelay-bench: {problem}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
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
                debug_assert!(SCENARIOS.contains(&$name), "{} is missing from SCENARIOS", $name);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Args, String> {
        parse_args(line.split_whitespace().map(str::to_owned))
    }

    #[test]
    fn the_command_line_is_read_and_mistakes_are_named() {
        let args = parse("--quick --only write,e2e --out r.json").unwrap();
        assert!(args.quick);
        assert_eq!(args.only, ["write", "e2e"]);
        assert_eq!(args.out, PathBuf::from("r.json"));
        let args = parse("").unwrap();
        assert!(!args.quick && args.only.is_empty());
        assert_eq!(parse("--help").err().as_deref(), Some(""));
        assert_eq!(parse("--only writes").err().as_deref(), Some("unknown scenario \"writes\""));
        assert_eq!(parse("--only").err().as_deref(), Some("--only needs a list of scenarios"));
        assert_eq!(parse("--fast").err().as_deref(), Some("unknown argument \"--fast\""));
    }
}
