//! Prometheus metrics: counters, gauges and histograms with explicit buckets, registered in one
//! process-wide registry and rendered in the Prometheus text format (0.0.4) by the admin HTTP
//! server (see [`crate::admin_http`]).
//!
//! Each metric is declared next to the code that moves it, as a `static` built on first use:
//!
//! ```ignore
//! static COMMITS: LazyLock<Histogram> = LazyLock::new(|| {
//!     metrics::histogram("reelay_writer_commit_seconds", "Time to commit one write batch.", &[], SECONDS)
//! });
//! COMMITS.observe(&[], elapsed.as_secs_f64());
//! ```
//!
//! Labels come from bounded sets only (handler names, outcomes, gRPC methods of mounted
//! services, status codes), never from ids. Gauges that mirror stored state are sampled when
//! Prometheus scrapes (a [`Sampler`]), so a scrape always agrees with the database.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::Duration;

use futures_util::future::BoxFuture;

/// Buckets for durations of a few milliseconds to a minute, in seconds.
pub const SECONDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Buckets for batch sizes.
pub const BATCH_SIZES: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Series {
    value: f64,
    /// Histograms: cumulative counts are computed when rendering; these are per bucket.
    buckets: Vec<u64>,
    count: u64,
}

struct Family {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    buckets: &'static [f64],
    series: Mutex<BTreeMap<Vec<String>, Series>>,
}

impl Family {
    fn with<R>(&self, values: &[&str], f: impl FnOnce(&mut Series) -> R) -> R {
        debug_assert_eq!(values.len(), self.labels.len(), "metric {} takes labels {:?}", self.name, self.labels);
        let mut series = self.series.lock().expect("metric lock");
        let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
        let entry =
            series.entry(key).or_insert_with(|| Series { buckets: vec![0; self.buckets.len()], ..Series::default() });
        f(entry)
    }

    fn render(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind.as_str());
        let series = self.series.lock().expect("metric lock");
        for (values, s) in series.iter() {
            let labels = label_text(self.labels, values, None);
            match self.kind {
                Kind::Counter | Kind::Gauge => {
                    let _ = writeln!(out, "{}{labels} {}", self.name, number(s.value));
                }
                Kind::Histogram => {
                    let mut cumulative = 0;
                    for (bound, count) in self.buckets.iter().zip(&s.buckets) {
                        cumulative += count;
                        let labels = label_text(self.labels, values, Some(&number(*bound)));
                        let _ = writeln!(out, "{}_bucket{labels} {cumulative}", self.name);
                    }
                    let labels_inf = label_text(self.labels, values, Some("+Inf"));
                    let _ = writeln!(out, "{}_bucket{labels_inf} {}", self.name, s.count);
                    let _ = writeln!(out, "{}_sum{labels} {}", self.name, number(s.value));
                    let _ = writeln!(out, "{}_count{labels} {}", self.name, s.count);
                }
            }
        }
    }
}

fn number(value: f64) -> String {
    if value.is_finite() && value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{}", value as i64)
    } else {
        value.to_string()
    }
}

fn label_text(names: &[&str], values: &[String], le: Option<&str>) -> String {
    let mut pairs: Vec<String> = names.iter().zip(values).map(|(n, v)| format!("{n}=\"{}\"", escape(v))).collect();
    if let Some(le) = le {
        pairs.push(format!("le=\"{le}\""));
    }
    if pairs.is_empty() { String::new() } else { format!("{{{}}}", pairs.join(",")) }
}

fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Refreshes gauges from stored state just before a scrape is rendered.
pub type Sampler = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

#[derive(Default)]
struct Registry {
    families: Mutex<Vec<Arc<Family>>>,
    samplers: Mutex<Vec<Sampler>>,
}

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::default)
}

fn register(
    name: &'static str,
    help: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    buckets: &'static [f64],
) -> Arc<Family> {
    let family = Arc::new(Family { name, help, kind, labels, buckets, series: Mutex::new(BTreeMap::new()) });
    let mut families = registry().families.lock().expect("registry lock");
    assert!(families.iter().all(|f| f.name != name), "metric {name} is declared twice");
    families.push(family.clone());
    family
}

/// A monotonically increasing count.
pub struct Counter(Arc<Family>);

impl Counter {
    pub fn inc(&self, labels: &[&str]) {
        self.inc_by(labels, 1);
    }

    pub fn inc_by(&self, labels: &[&str], by: u64) {
        self.0.with(labels, |s| s.value += by as f64);
    }

    /// Makes the series of `labels` scraped, at 0 until it is counted.
    pub fn declare(&self, labels: &[&str]) {
        self.inc_by(labels, 0);
    }

    /// The current value of one series (tests and status output).
    pub fn get(&self, labels: &[&str]) -> u64 {
        self.0.with(labels, |s| s.value as u64)
    }
}

/// A value that goes up and down.
pub struct Gauge(Arc<Family>);

impl Gauge {
    pub fn set(&self, labels: &[&str], value: f64) {
        self.0.with(labels, |s| s.value = value);
    }

    /// Moves one series by `delta` (what several tasks count up and down together; a 0 makes
    /// the series scraped).
    pub fn add(&self, labels: &[&str], delta: f64) {
        self.0.with(labels, |s| s.value += delta);
    }

    /// The current value of one series (tests).
    pub fn get(&self, labels: &[&str]) -> f64 {
        self.0.with(labels, |s| s.value)
    }

    /// Drops every series (before a sampler sets the current ones, so a handler that went away
    /// does not linger).
    pub fn clear(&self) {
        self.0.series.lock().expect("metric lock").clear();
    }
}

/// A distribution over explicit buckets.
pub struct Histogram(Arc<Family>);

impl Histogram {
    pub fn observe(&self, labels: &[&str], value: f64) {
        let bounds = self.0.buckets;
        self.0.with(labels, |s| {
            if let Some(i) = bounds.iter().position(|b| value <= *b) {
                s.buckets[i] += 1;
            }
            s.count += 1;
            s.value += value;
        });
    }

    pub fn observe_duration(&self, labels: &[&str], elapsed: Duration) {
        self.observe(labels, elapsed.as_secs_f64());
    }
}

/// A counter; one without labels is scraped at 0 from the start (`rate()` then sees its first
/// increment). A labelled one's series appear as they are counted, or at 0 by [`Counter::declare`].
pub fn counter(name: &'static str, help: &'static str, labels: &'static [&'static str]) -> Counter {
    let counter = Counter(register(name, help, Kind::Counter, labels, &[]));
    if labels.is_empty() {
        counter.declare(&[]);
    }
    counter
}

pub fn gauge(name: &'static str, help: &'static str, labels: &'static [&'static str]) -> Gauge {
    Gauge(register(name, help, Kind::Gauge, labels, &[]))
}

pub fn histogram(
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
    buckets: &'static [f64],
) -> Histogram {
    assert!(buckets.windows(2).all(|w| w[0] < w[1]), "metric {name}: buckets must increase");
    Histogram(register(name, help, Kind::Histogram, labels, buckets))
}

static SAMPLES_FAILED: LazyLock<Counter> = LazyLock::new(|| {
    counter(
        "reelay_metrics_samples_failed_total",
        "Scrapes whose sampled gauges could not be read, or took over 5 s: their last values were served.",
        &[],
    )
});

/// Adds a sampler run before every scrape.
pub fn add_sampler(sampler: Sampler) {
    LazyLock::force(&SAMPLES_FAILED);
    registry().samplers.lock().expect("registry lock").push(sampler);
}

/// Says a sampler could not read what it samples: its gauges keep their last values, which
/// this counter marks as stale.
pub fn sample_failed() {
    SAMPLES_FAILED.inc(&[]);
}

/// Runs the samplers (each bounded in time) and renders every registered metric. Scrapes
/// sample one at a time: parallel ones would each run every sampler's queries at once, and one's
/// reset of a gauge could land between another's values (a scrape missing series).
pub async fn render() -> String {
    static SAMPLING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    {
        let _one_at_a_time = SAMPLING.lock().await;
        let samplers: Vec<Sampler> = registry().samplers.lock().expect("registry lock").clone();
        for sampler in samplers {
            if tokio::time::timeout(Duration::from_secs(5), sampler()).await.is_err() {
                tracing::warn!("a metrics sampler took over 5 s; serving its last values");
                sample_failed();
            }
        }
        // Rendered before the next scrape's samplers run: one's reset of a gauge must not land
        // between another's sampling and rendering.
        let families: Vec<Arc<Family>> = registry().families.lock().expect("registry lock").clone();
        let mut out = String::new();
        for family in families {
            family.render(&mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scrapes at once sample one after another.
    #[tokio::test]
    async fn samplers_run_one_scrape_at_a_time() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (r, m) = (running.clone(), most.clone());
        add_sampler(Arc::new(move || -> futures_util::future::BoxFuture<'static, ()> {
            let (r, m) = (r.clone(), m.clone());
            Box::pin(async move {
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                r.fetch_sub(1, Ordering::SeqCst);
            })
        }));
        futures_util::future::join_all((0..4).map(|_| render())).await;
        assert_eq!(most.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn renders_the_text_format() {
        let c = counter("test_things_total", "Things.", &["outcome"]);
        c.inc(&["ok"]);
        c.inc_by(&["failed"], 2);
        let h = histogram("test_latency_seconds", "Latency.", &[], &[0.1, 1.0]);
        h.observe(&[], 0.25);
        h.observe(&[], 0.5);
        h.observe(&[], 4.0);
        let g = gauge("test_rows", "Rows.", &["status"]);
        g.set(&["done"], 3.0);
        let text = render().await;
        assert!(text.contains("# TYPE test_things_total counter\n"), "{text}");
        assert!(text.contains("test_things_total{outcome=\"failed\"} 2\n"), "{text}");
        assert!(text.contains("test_latency_seconds_bucket{le=\"0.1\"} 0\n"), "{text}");
        assert!(text.contains("test_latency_seconds_bucket{le=\"1\"} 2\n"), "{text}");
        assert!(text.contains("test_latency_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("test_latency_seconds_count 3\n"), "{text}");
        assert!(text.contains("test_latency_seconds_sum 4.75\n"), "{text}");
        // A counter without labels is there at 0 before it first counts; a labelled one's
        // series once declared.
        counter("test_resumed_total", "Resumed.", &[]);
        c.declare(&["skipped"]);
        let text = render().await;
        assert!(text.contains("\ntest_resumed_total 0\n"), "{text}");
        assert!(text.contains("test_things_total{outcome=\"skipped\"} 0\n"), "{text}");
        assert!(text.contains("test_rows{status=\"done\"} 3\n"), "{text}");
        assert_eq!(c.get(&["ok"]), 1);
    }

    #[test]
    fn escapes_label_values() {
        assert_eq!(label_text(&["a"], &["x\"y\\z".into()], None), "{a=\"x\\\"y\\\\z\"}");
    }
}
