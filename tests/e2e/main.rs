//! Reelay's end-to-end tests: real `reelay` processes, real SQLite files, a real nats-server,
//! real gRPC. One test binary (it links once), one module per family of scenarios.

mod admin;
mod bad_input;
mod chaos;
mod cli;
mod delivery_db;
mod delivery_nats;
mod enrichment;
mod faults;
mod federation;
mod handlers;
mod import;
mod k8s;
mod licences;
mod logs;
mod media;
mod metrics;
mod migrations;
mod retention;
mod search;
mod write_events;

use std::path::Path;
use std::time::Duration;

use reelay_harness::{Reelay, eventually, query_strings};

/// What a handler of this build needs to run in the test process against `reelay`'s write
/// service: its data dir (the process's) and an authenticated channel.
fn handler_context(reelay: &reelay_harness::Reelay) -> reelay_delivery::HandlerContext {
    let url = format!("http://{}", reelay.addr);
    let write =
        reelay_kit::client::connect_lazy(&url, Some(reelay_harness::TEST_TOKEN), std::time::Duration::from_secs(30))
            .expect("a channel to the write service");
    reelay_delivery::HandlerContext { data_dir: reelay.database.parent().unwrap().to_owned(), write }
}

/// A handlers process of probe-a alone, an 8 s call per batch, that reaches the write service
/// through `proxy` (which can cut it off), with `env` on top (the broker's, on nats). Its own
/// lease setting is a minute, longer than the write service's 3 s in the tests that use it: it
/// must go by the lease the write service's claim answers give.
async fn slow_probe_behind(
    proxy: &reelay_harness::CuttingProxy,
    dir: &Path,
    effects: &Path,
    env: &[(&str, &str)],
) -> Reelay {
    let effects = effects.to_str().unwrap();
    let mut all = vec![
        ("REELAY_PROBE_HANDLERS", "probe-a"),
        ("REELAY_PROBE_DB", effects),
        ("REELAY_PROBE_DELAY_MS", "8000"),
        ("REELAY_LEDGER_LEASE_MS", "60000"),
    ];
    all.extend_from_slice(env);
    let mut spec =
        Reelay::spec(env!("CARGO_BIN_EXE_reelay"), &dir.join("cut-off").join("unused.db"), &["handlers"], &all);
    spec.env.push(("REELAY_WRITE_URL".into(), format!("http://{}", proxy.addr)));
    Reelay::start(spec).await
}

/// How late the proxy of [`a_claim_heard_late`] passes answers on: most of the way through the
/// write service's 3 s lease, so a run started on the answer (a 1.5 s call) would end after the
/// lease has run out.
const LATE_ANSWER: Duration = Duration::from_millis(2_400);

/// A probe-a process (a 1.5 s call) behind a proxy that passes every answer of the write service
/// on [`LATE_ANSWER`] late, with `env` on top. Writes a user (through `c`), waits until probe-a's
/// claim on the event is stored, and from then on holds every request of that process: its claim
/// answer is still on its way, and no renewal reaches the write service. Returns the event's id,
/// when its claim was seen, the proxy and the process.
async fn a_claim_heard_late(
    cluster: &reelay_harness::Cluster,
    c: &mut reelay_harness::Clients,
    dir: &Path,
    env: &[(&str, &str)],
) -> (String, std::time::Instant, reelay_harness::CuttingProxy, Reelay) {
    let proxy = reelay_harness::CuttingProxy::start(cluster.write.addr).await;
    let mut all = vec![("REELAY_PROBE_DELAY_MS", "1500")];
    all.extend_from_slice(env);
    let handlers = slow_probe_behind(&proxy, dir, &cluster.effects, &all).await;
    proxy.delay_answers(LATE_ANSWER);
    c.user("ana").await;
    let event_id = reelay_harness::event_ids(&cluster.db).await.remove(0);
    let sql = format!("SELECT status FROM processed_events WHERE event_id = '{event_id}' AND handler = 'probe-a'");
    eventually("probe-a's claim is stored", Duration::from_secs(20), || async {
        query_strings(&cluster.db, &sql).await.first().is_some_and(|r| r[0] == "in_progress")
    })
    .await;
    proxy.hold_requests();
    let claimed_at = std::time::Instant::now();
    (event_id, claimed_at, proxy, handlers)
}

/// Checks that probe-a's run of `event_id` in `process` (`what`: which run) was dropped: it left
/// no effect, and the process logged the drop.
async fn dropped_without_effect(effects: &Path, event_id: &str, process: &Reelay, what: &str) {
    let (effects, _) = reelay_harness::probe_records(effects, "effects").await;
    let log = process.log_text();
    assert_eq!(effects.get(&(event_id.to_owned(), "probe-a".to_owned())), None, "{what} was dropped: {log}");
    assert!(log.contains("its work is dropped unsettled"), "{log}");
}

/// Freezes `process` (SIGSTOP) while probe-a's 3 s call of `event_id` is under way, for as long
/// as `taken_over` takes to see the event handed to another claimer (the lease, 3 s, runs out
/// meanwhile) and 2 s more; lets it run again until it logs the drop; and checks that the frozen
/// run was dropped: when it wakes its call's time is up as well as its lease, and the lease
/// comes first. (It is frozen early in the call, so a slow machine cannot let the call end
/// before the freeze.)
async fn frozen_until_taken_over(
    process: &Reelay,
    effects: &Path,
    event_id: &str,
    taken_over: impl std::future::Future<Output = ()>,
) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    process.pause();
    let (before, _) = reelay_harness::probe_records(effects, "effects").await;
    assert_eq!(before.get(&(event_id.to_owned(), "probe-a".to_owned())), None, "frozen inside the call");
    taken_over.await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    process.resume();
    eventually("the woken process drops its run", Duration::from_secs(20), || async {
        process.log_text().contains("its work is dropped unsettled")
    })
    .await;
    dropped_without_effect(effects, event_id, process, "the frozen run").await;
}

/// Waits until `n` claims wait with the writer for new events (on db one per claim call, which
/// may claim for several handlers; the relay's on nats).
async fn claims_waiting(write: &Reelay, n: f64) {
    eventually(&format!("{n} claims wait with the writer"), Duration::from_secs(10), || async move {
        write.metrics().await.value("reelay_claims_waiting") == Some(n)
    })
    .await;
}

/// Writes a user a round, with `proxy` (between the write service and the claimer under test)
/// set to cut the next answer it carries, until the write service's counter `resumed` says a
/// claim answer that never arrived was handed back; returns that round's event. Each round's
/// event must be `done` within 15 s, well inside the 30 s lease that a lost answer would
/// otherwise hold it for. Before each cut the last round's answers (its settlement) are let out
/// and a claim waits with the writer, so the cut takes a claim's answer; unless that claim's long
/// poll ends first (every second, with nothing): then the event is handled as usual and the next
/// round cuts again, five rounds at most.
async fn cut_claim_answers_until_one_is_handed_back<F, Fut>(
    write: &Reelay,
    proxy: &reelay_harness::CuttingProxy,
    resumed: &str,
    done: F,
) -> String
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut c = write.clients().await;
    for round in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        eventually("a claim waits with the writer", Duration::from_secs(10), || async {
            write.metrics().await.value("reelay_claims_waiting").is_some_and(|n| n >= 1.0)
        })
        .await;
        let before = reelay_harness::event_ids(&write.database).await;
        proxy.cut_next_answer();
        c.user(&format!("user{round}")).await;
        let event_id =
            reelay_harness::event_ids(&write.database).await.into_iter().find(|e| !before.contains(e)).unwrap();
        eventually("the event is handled well within the lease of a lost claim", Duration::from_secs(15), || {
            done(event_id.clone())
        })
        .await;
        if write.metrics().await.value(resumed).is_some_and(|n| n > 0.0) {
            return event_id;
        }
    }
    panic!("no cut answer was a claim's with an event in it");
}

/// How long each fsync of the write service waits while a claim's caller goes away: long, so the
/// calls' deadlines (3 s, 7 s) leave a traced (so slowed) write service on a loaded machine time
/// to start the claim's commit first, and still pass before it ends.
const SLOW_FSYNC: Duration = Duration::from_secs(10);

/// How a claim's answer is lost, in [`claims_for_a_caller_that_went_away_are_handed_back`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lost {
    /// The caller goes away while a claim job of its own is written (the event was due when
    /// the call came); its next call names it at once, while that claim is still being written.
    ClaimJob,
    /// The same for a call waiting when the event was written: the claim rides in its batch.
    WrittenWithTheEvent,
    /// As `ClaimJob`, and once the claim is written the write service is killed (SIGKILL) and
    /// started again before the next call names it.
    ThenRestarted,
}

/// A claim made for a caller that went away while its commit was on its way to the disk (a slow
/// fsync; the call's deadline passed first) is handed back to the claimer's next call naming
/// that call instead of waiting out its lease (see [`Lost`] for the three ways).
/// `new_event(n)` writes an event the claimer takes and returns its id; `claim(outbox,
/// call_id, unanswered, wait_ms, deadline)` makes a call and returns the ids of the events it
/// was handed; `held` is a query of `db` counting the rows the claimer holds; the write
/// service's counter `resumed` counts what it handed back.
async fn claims_for_a_caller_that_went_away_are_handed_back<E, EF, C, CF>(
    write: &mut Reelay,
    (dir, db): (&Path, &Path),
    (resumed, held): (&str, &str),
    new_event: E,
    claim: C,
) where
    E: Fn(usize) -> EF,
    EF: Future<Output = String>,
    C: Fn(Outbox, u64, Vec<u64>, u32, Duration) -> CF,
    CF: Future<Output = Result<Vec<String>, tonic::Status>> + Send + 'static,
{
    let mut outbox = write.clients().await.outbox;
    let mut handed_back = 0;
    let cases = [(1, Lost::ClaimJob), (3, Lost::WrittenWithTheEvent), (5, Lost::ThenRestarted)];
    for (n, (gone_call, lost)) in cases.into_iter().enumerate() {
        let written_with_the_event = lost == Lost::WrittenWithTheEvent;
        let event = if written_with_the_event { None } else { Some(new_event(n).await) };
        let slow = reelay_harness::Strace::delay(write.pid(), "fsync,fdatasync", SLOW_FSYNC, dir).await;
        // The deadline leaves room for the claim (or the event's batch, for a waiting call) to
        // start before it, and passes well before that claim's slow commit ends.
        let (wait_ms, deadline) = if written_with_the_event { (20_000, 7_000) } else { (0, 3_000) };
        let call = tokio::spawn(claim(outbox.clone(), gone_call, Vec::new(), wait_ms, Duration::from_millis(deadline)));
        let event = match event {
            Some(event) => event,
            None => {
                claims_waiting(write, 1.0).await;
                new_event(n).await
            }
        };
        let answer = call.await.unwrap();
        assert!(answer.is_err(), "the call's deadline passes while its claim is written: {answer:?}");
        if lost == Lost::ThenRestarted {
            let written = [vec![(handed_back + 1).to_string()]];
            eventually("the claim is written", Duration::from_secs(30), || async {
                query_strings(db, held).await == written
            })
            .await;
            // SIGKILL: the strace attached to it ends with it.
            write.restart().await;
            outbox = write.clients().await.outbox;
            // The restarted service counts from nothing.
            handed_back = 0;
        }
        let handed = claim(outbox.clone(), gone_call + 1, vec![gone_call], 0, Duration::from_secs(30)).await;
        assert_eq!(handed.unwrap(), [event], "the event claimed for the call that went away, handed back");
        assert!(slow.stop().await > 0, "the write service's fsyncs waited");
        handed_back += 1;
        assert_eq!(write.metrics().await.value(resumed), Some(f64::from(handed_back)));
    }
}

/// The Outbox API's client, as a test's claim calls use it.
type Outbox = reelay_contracts::v1::outbox_client::OutboxClient<reelay_harness::AuthedChannel>;

/// The write service's batches so far, and its write jobs named `job`.
async fn batches_and_jobs(write: &Reelay, job: &str) -> (f64, f64) {
    let metrics = write.metrics().await;
    let jobs = metrics.value(&format!(r#"reelay_writer_job_seconds_count{{job="{job}"}}"#)).unwrap_or(0.0);
    (metrics.sum("reelay_writer_batch_jobs_count", &[]), jobs)
}

/// Waits until the write service has stored the key pairs of `users` users: each is a write
/// job of its own, in the background, that must not land while a test counts batches.
async fn key_pairs_stored(db: &Path, users: usize) {
    let want = vec![vec![users.to_string()]];
    eventually("the users' key pairs are stored", Duration::from_secs(60), || async {
        query_strings(db, "SELECT COUNT(*) || '' FROM actor_keys").await == want
    })
    .await;
}

/// The harness's own start-up: a process whose chosen port another test's server took (between
/// choosing and binding it) exits on it, and is started on fresh ports; the other server, which
/// answers health checks on that port too, is not taken for it.
#[tokio::test]
async fn a_process_whose_port_another_server_took_starts_on_fresh_ports() {
    const BIN: &str = env!("CARGO_BIN_EXE_reelay");
    let dir = reelay_harness::temp_dir();
    let other = Reelay::start_write(BIN, &dir.path().join("other/reelay.db"), &[]).await;
    let spec = Reelay::spec(BIN, &dir.path().join("mine/reelay.db"), &["write"], &[]);
    let fresh = || format!("127.0.0.1:{}", reelay_harness::free_port()).parse().unwrap();
    let mut offered = 0;
    let mine = Reelay::start_on(spec, || {
        offered += 1;
        let write = if offered == 1 { other.addr } else { fresh() };
        [write, fresh(), fresh(), fresh(), fresh()]
    })
    .await;
    assert_eq!(offered, 2, "the taken port is given up after one launch");
    assert_ne!(mine.addr, other.addr);
    assert!(mine.log_text().contains("Address already in use"), "{}", mine.log_text());
    // What answers at its address is this process, on its own database.
    let mut c = mine.clients().await;
    c.user("mine").await;
    let users = |db: std::path::PathBuf| async move {
        query_strings(&db, "SELECT handle FROM users").await.into_iter().flatten().collect::<Vec<_>>()
    };
    assert_eq!(users(dir.path().join("mine/reelay.db")).await, ["mine"]);
    assert!(users(dir.path().join("other/reelay.db")).await.is_empty());
}
