//! Per-handler delivery on a real SQLite file, with the clock injected: each handler's own
//! cursor, attempts, schedule and fate; leases, take-over and a restarted instance's claims.

use std::time::Duration;

use futures_util::future::BoxFuture;
use reelay_contracts::v1;
use reelay_domain::{NewEvent, RetryPolicy};
use reelay_outbox::dead_letters::{self, Acted, Action, Target};
use reelay_outbox::deliveries::{
    self, ClaimError, ClaimedDelivery, DeliveryOutcome, HandlerClaim, HandlerPolicy, RetireError, Settlement,
};
use reelay_outbox::{CommitError, Database, DbConfig, WriteTx, enqueue_events};
use sqlx::Row;

mod common;
use common::t0;

#[derive(Debug)]
#[allow(dead_code, reason = "shown by Debug when a test fails")]
enum Error {
    Commit(CommitError),
    Sql(sqlx::Error),
    Claim(ClaimError),
}

impl From<CommitError> for Error {
    fn from(e: CommitError) -> Self {
        Self::Commit(e)
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Sql(e)
    }
}

impl From<ClaimError> for Error {
    fn from(e: ClaimError) -> Self {
        Self::Claim(e)
    }
}

async fn job<T, F>(db: &Database, work: F) -> Result<T, Error>
where
    T: Send + 'static,
    F: for<'t> FnOnce(&'t mut WriteTx) -> BoxFuture<'t, Result<T, Error>> + Send + 'static,
{
    db.writer.transact::<T, Error, _>("test", work).await
}

const POLICY: HandlerPolicy = HandlerPolicy {
    lease: Duration::from_secs(30),
    max_attempts: 3,
    retry: RetryPolicy { base: Duration::from_secs(5), cap: Duration::from_secs(300) },
};

async fn open() -> (tempfile::TempDir, Database) {
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(&DbConfig::new(dir.path().join("d.db"))).await.unwrap();
    (dir, db)
}

/// Enqueues `n` events: even ones `MovieDeleted`, odd ones `UserRegistered`.
async fn enqueue(db: &Database, n: usize) {
    job(db, move |tx| {
        Box::pin(async move {
            let events = (0..n)
                .map(|i| {
                    let payload = if i % 2 == 0 {
                        v1::event::Payload::MovieDeleted(v1::MovieDeleted { movie_id: i.to_string() })
                    } else {
                        v1::event::Payload::UserRegistered(v1::UserRegistered {
                            user_id: i.to_string(),
                            ..Default::default()
                        })
                    };
                    NewEvent::new(i, payload)
                })
                .collect();
            enqueue_events(tx, events).await.expect("small events fit");
            Ok(())
        })
    })
    .await
    .unwrap();
}

async fn register(db: &Database, handlers: &[&str], now: i64) -> Vec<String> {
    let handlers: Vec<String> = handlers.iter().map(|h| h.to_string()).collect();
    job(db, move |tx| Box::pin(async move { Ok(deliveries::register(tx, &handlers, now).await?) })).await.unwrap()
}

fn request(handler: &str, types: &[&str], owner: &str) -> HandlerClaim {
    HandlerClaim {
        handler: handler.into(),
        event_types: types.iter().map(|t| t.to_string()).collect(),
        owner: owner.into(),
        max_rows: 100,
        max_bytes: 4 * 1024 * 1024,
        call: 0,
        shared: None,
    }
}

/// Claims in one job, committed whatever the answers, as the write service commits a claim job
/// (a refused claim still notes its handler's build).
async fn claim_all(
    db: &Database,
    requests: Vec<HandlerClaim>,
    now: i64,
) -> Vec<Result<Vec<ClaimedDelivery>, ClaimError>> {
    job(db, move |tx| Box::pin(async move { Ok(deliveries::claim_many(tx, now, POLICY, &requests).await?) }))
        .await
        .unwrap()
}

/// One claim, committed whatever its answer (see [`claim_all`]).
async fn claim(db: &Database, request: &HandlerClaim, now: i64) -> Result<Vec<ClaimedDelivery>, Error> {
    Ok(claim_all(db, vec![request.clone()], now).await.pop().expect("one answer per request")?)
}

/// A database with handler `h` registered, and claims of two builds of it: an older one that
/// takes MovieDeleted, and a newer one that also takes UserRegistered.
async fn two_builds() -> (tempfile::TempDir, Database, HandlerClaim, HandlerClaim) {
    let (dir, db) = open().await;
    register(&db, &["h"], t0()).await;
    let old = request("h", &["MovieDeleted"], "old-1#x");
    let new = request("h", &["UserRegistered", "MovieDeleted"], "new-1#y");
    (dir, db, old, new)
}

/// Handler h's builds as `reelay status` shows them at `now`: (types, live, handed), newest
/// first; the writer started at `started`.
async fn builds_at(db: &Database, now: i64, started: i64) -> Vec<(String, bool, bool)> {
    let mut conn = db.reads.acquire().await.unwrap();
    let builds = deliveries::builds(&mut conn, now, started, POLICY.lease).await.unwrap();
    builds.into_iter().filter(|b| b.handler == "h").map(|b| (b.event_types.join(","), b.live, b.handed)).collect()
}

async fn settle(db: &Database, handler: &str, settlements: Vec<Settlement>, now: i64) -> deliveries::Settled {
    let handler = handler.to_owned();
    job(db, move |tx| Box::pin(async move { Ok(deliveries::settle(tx, &handler, &settlements, now, POLICY).await?) }))
        .await
        .unwrap()
}

fn outcome(delivery: &ClaimedDelivery, outcome: DeliveryOutcome) -> Settlement {
    Settlement { key: delivery.key.clone(), token: delivery.token, outcome }
}

/// Puts a ledger row in place by hand: `sql` with the event id as ?1 and t0() as ?2.
async fn put_ledger_row(db: &Database, sql: &'static str, key: String) {
    job(db, move |tx| {
        Box::pin(async move {
            sqlx::query(sql).bind(key).bind(t0()).execute(tx.conn()).await?;
            Ok(())
        })
    })
    .await
    .unwrap();
}

async fn state(db: &Database, key: &str, handler: &str) -> (String, i64) {
    let r = sqlx::query("SELECT status, attempts FROM processed_events WHERE event_id = ? AND handler = ?")
        .bind(key)
        .bind(handler)
        .fetch_one(&db.reads)
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

#[tokio::test]
async fn each_handler_gets_its_own_events_attempts_and_fate() {
    let (_dir, db) = open().await;
    register(&db, &["a", "b"], t0()).await;
    enqueue(&db, 6).await;
    let a = request("a", &["MovieDeleted", "UserRegistered"], "p1#x");
    let b = request("b", &["MovieDeleted"], "p2#x");
    let for_a = claim(&db, &a, t0()).await.unwrap();
    let for_b = claim(&db, &b, t0()).await.unwrap();
    assert_eq!(for_a.len(), 6, "a takes both types");
    assert_eq!(for_b.len(), 3, "b only MovieDeleted");
    assert!(for_b.iter().all(|d| d.event_type == "MovieDeleted" && d.attempt == 1));
    assert!(claim(&db, &a, t0()).await.unwrap().is_empty(), "nothing is handed out twice");

    // a gives up on its second event for good and finishes the rest; b fails its first event
    // (which a finished) and is retried.
    let settlements = for_a
        .iter()
        .enumerate()
        .map(|(i, d)| match i {
            1 => outcome(d, DeliveryOutcome::Failed { error: "cannot parse".into(), terminal: true }),
            _ => outcome(d, DeliveryOutcome::Done),
        })
        .collect();
    let settled = settle(&db, "a", settlements, t0() + 10).await;
    assert_eq!(settled.dead_lettered, vec![for_a[1].key.clone()]);
    let mut settlements = vec![outcome(&for_b[0], DeliveryOutcome::Failed { error: "busy".into(), terminal: false })];
    settlements.extend(for_b[1..].iter().map(|d| outcome(d, DeliveryOutcome::Done)));
    settle(&db, "b", settlements, t0() + 10).await;
    assert_eq!(state(&db, &for_a[1].key, "a").await, ("dead_lettered".into(), 1));
    assert_eq!(state(&db, &for_b[0].key, "b").await, ("retry".into(), 1), "b's fate is its own");

    // b's retry is due 5 s later, not a millisecond sooner; a is not involved.
    assert!(claim(&db, &b, t0() + 5_009).await.unwrap().is_empty());
    let retry = claim(&db, &b, t0() + 5_010).await.unwrap();
    assert_eq!((retry.len(), retry[0].key.clone(), retry[0].attempt), (1, for_b[0].key.clone(), 2));
    assert!(retry[0].token > for_b[0].token, "a new claim, a newer token");
    // Fails again, then the third failure dead-letters it (max 3 attempts), with its error.
    settle(
        &db,
        "b",
        vec![outcome(&retry[0], DeliveryOutcome::Failed { error: "busy 2".into(), terminal: false })],
        t0() + 5_020,
    )
    .await;
    let third = claim(&db, &b, t0() + 5_020 + 10_000).await.unwrap();
    assert_eq!(third[0].attempt, 3);
    settle(
        &db,
        "b",
        vec![outcome(&third[0], DeliveryOutcome::Failed { error: "busy 3".into(), terminal: false })],
        t0() + 20_000,
    )
    .await;
    let row =
        sqlx::query("SELECT status, attempts, last_error FROM processed_events WHERE event_id = ? AND handler = 'b'")
            .bind(&for_b[0].key)
            .fetch_one(&db.reads)
            .await
            .unwrap();
    assert_eq!(
        (row.get::<String, _>(0), row.get::<i64, _>(1), row.get::<String, _>(2)),
        ("dead_lettered".into(), 3, "busy 3".into())
    );
    assert_eq!(state(&db, &for_b[0].key, "a").await, ("done".into(), 0), "a finished that event regardless");
}

#[tokio::test]
async fn during_a_rolling_update_only_the_newest_build_of_a_handler_is_handed_anything() {
    let (_dir, db, old, new) = two_builds().await;
    #[track_caller]
    fn standing_by(result: Result<Vec<ClaimedDelivery>, Error>) -> String {
        match result {
            Err(Error::Claim(ClaimError::StandingBy(why))) => why,
            other => panic!("expected standing by, got {other:?}"),
        }
    }
    assert!(claim(&db, &old, t0()).await.unwrap().is_empty(), "the old build claims alone");

    // The new build (it also takes UserRegistered) begins claiming: from now on the old one,
    // which would move the cursor past UserRegistered rows, stands by, and says why.
    assert!(claim(&db, &new, t0() + 1_000).await.unwrap().is_empty());
    enqueue(&db, 4).await;
    let why = standing_by(claim(&db, &old, t0() + 2_000).await);
    assert!(why.contains("[MovieDeleted,UserRegistered]") && why.contains("[MovieDeleted]"), "{why}");
    let handed = claim(&db, &new, t0() + 3_000).await.unwrap();
    assert_eq!(handed.len(), 4, "every row is the new build's, none passed over: {handed:?}");
    let (both, new_build, old_build) = (
        vec![("MovieDeleted,UserRegistered".to_owned(), true, true), ("MovieDeleted".to_owned(), true, false)],
        "MovieDeleted,UserRegistered".to_owned(),
        "MovieDeleted".to_owned(),
    );
    assert_eq!(builds_at(&db, t0() + 3_000, 0).await, both, "the operator's view: which build is handed work");

    // A retry of a type only the new build takes is not handed to the old one either.
    let user = handed.iter().find(|d| d.event_type == "UserRegistered").unwrap();
    let mut settlements = vec![outcome(user, DeliveryOutcome::Failed { error: "busy".into(), terminal: false })];
    settlements.extend(handed.iter().filter(|d| d.key != user.key).map(|d| outcome(d, DeliveryOutcome::Done)));
    settle(&db, "h", settlements, t0() + 3_100).await;
    standing_by(claim(&db, &old, t0() + 20_000).await);
    let retry = claim(&db, &new, t0() + 20_000).await.unwrap();
    assert_eq!((retry.len(), retry[0].key.clone(), retry[0].attempt), (1, user.key.clone(), 2));
    settle(&db, "h", vec![outcome(&retry[0], DeliveryOutcome::Done)], t0() + 20_100).await;

    // A claimer of the new build's other instances is handed deliveries as usual.
    let other_instance = request("h", &["MovieDeleted", "UserRegistered"], "new-2#z");
    assert!(claim(&db, &other_instance, t0() + 21_000).await.unwrap().is_empty());

    // The new build stops (rolled back): four leases after its last claim noted (at 20 s; they
    // are noted every quarter lease) the old one is handed deliveries again, from where the new
    // build left the cursor.
    standing_by(claim(&db, &old, t0() + 20_000 + 120_000).await);
    enqueue(&db, 2).await;
    let resumed = claim(&db, &old, t0() + 20_000 + 120_001).await.unwrap();
    assert_eq!(resumed.iter().map(|d| d.event_type.as_str()).collect::<Vec<_>>(), vec!["MovieDeleted"]);
    let gone = t0() + 20_000 + 120_001;
    assert_eq!(builds_at(&db, gone, 0).await, vec![(new_build, false, false), (old_build, true, true)]);
    // Had the writer started a second before, it could not have heard the new build lately:
    // the builds live when it started stay live (and the newest handed work) four leases more.
    assert_eq!(builds_at(&db, gone, gone - 1_000).await, both, "live when the writer started");

    // Claiming again after that long without, the new build is the newest once more (and the
    // UserRegistered row the old one passed over is not its: that build did not run then).
    assert!(claim(&db, &new, t0() + 150_000).await.unwrap().is_empty());
    standing_by(claim(&db, &old, t0() + 150_001).await);
}

#[tokio::test]
async fn builds_not_heard_from_for_the_ledger_retention_are_forgotten() {
    let (_dir, db, old, new) = two_builds().await;
    assert!(claim(&db, &old, t0()).await.unwrap().is_empty());
    assert!(claim(&db, &new, t0() + 60_000).await.unwrap().is_empty());
    let purge = |cutoff: i64, batch: u32| {
        job(&db, move |tx| Box::pin(async move { Ok(deliveries::purge_builds(tx, cutoff, batch).await?) }))
    };
    assert_eq!(purge(t0(), 10).await.unwrap(), 0, "both heard from since");
    assert_eq!(purge(t0() + 1, 10).await.unwrap(), 1, "the old build is forgotten");
    assert_eq!(builds_at(&db, t0() + 60_000, 0).await, vec![("MovieDeleted,UserRegistered".to_owned(), true, true)]);
    // Back after that, it is noted as the newest build: the one deployed last.
    assert!(claim(&db, &old, t0() + 90_000).await.unwrap().is_empty());
    assert_eq!(builds_at(&db, t0() + 90_000, 0).await[0], ("MovieDeleted".to_owned(), true, true));
    // Retention's ledger purge takes them too, a batch at a time (no ledger rows here).
    let ledger_purge = |now: i64| {
        let policy = reelay_outbox::ledger::LedgerPolicy::default();
        job(&db, move |tx| Box::pin(async move { Ok(reelay_outbox::ledger::purge(tx, now, policy, 1, true).await?) }))
    };
    let month = reelay_outbox::ledger::LedgerPolicy::default().retention.as_millis() as i64;
    assert_eq!(ledger_purge(t0() + 90_000 + month).await.unwrap(), 1, "a batch at a time");
    assert_eq!(ledger_purge(t0() + 90_000 + month).await.unwrap(), 0, "the other was heard from at 90 s");
    assert_eq!(ledger_purge(t0() + 90_001 + month).await.unwrap(), 1);
    assert!(builds_at(&db, t0() + 90_001 + month, 0).await.is_empty());
}

#[tokio::test]
async fn a_handler_is_retirable_only_once_no_process_can_still_run_it() {
    let (_dir, db, old, _) = two_builds().await;
    assert!(claim(&db, &old, t0()).await.unwrap().is_empty(), "h's build is heard from at t0");
    let retirable = |handler: &'static str, now: i64, started: i64| {
        let db = db.clone();
        async move {
            let mut conn = db.reads.acquire().await.unwrap();
            deliveries::check_retirable(&mut conn, handler, now, started, POLICY.lease).await
        }
    };
    assert!(matches!(retirable("h", t0() + 1_000, 0).await, Err(RetireError::Delivered(_))));
    assert!(matches!(retirable("nope", t0() + 1_000, 0).await, Err(RetireError::Unknown(_))));
    // The write service no longer delivers to h: retirable four leases (2 min) after it was
    // last heard from.
    register(&db, &["other"], t0() + 1_000).await;
    assert!(matches!(retirable("h", t0() + 120_000, 0).await, Err(RetireError::Live(_))));
    assert!(retirable("h", t0() + 120_001, 0).await.is_ok());
    // A write service that started at 100 s (after an outage), when h was still live, may not
    // have heard from h's processes since: h counts as run somewhere until four leases after
    // that start, not after h was last heard from.
    let started = t0() + 100_000;
    match retirable("h", t0() + 130_000, started).await {
        Err(RetireError::Live(why)) => assert!(why.contains("before this write service started"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(retirable("h", started + 119_999, started).await, Err(RetireError::Live(_))));
    assert!(retirable("h", started + 120_000, started).await.is_ok());
}

#[tokio::test]
async fn a_newer_build_claiming_first_in_the_same_job_as_an_older_one_wins() {
    let (_dir, db, old, new) = two_builds().await;
    assert!(claim(&db, &old, t0()).await.unwrap().is_empty());
    enqueue(&db, 4).await;
    // The older build's claim comes first in the job that sees the newer build's first.
    let answers = claim_all(&db, vec![old, new], t0() + 1_000).await;
    assert!(matches!(&answers[0], Err(ClaimError::StandingBy(_))), "{:?}", answers[0]);
    assert_eq!(answers[1].as_ref().unwrap().len(), 4, "the newer build is handed every row");
}

#[tokio::test]
async fn idle_builds_stay_live_while_they_are_heard_from_and_the_first_heard_from_last_stays_newest() {
    let (_dir, db, old, new) = two_builds().await;
    assert!(claim(&db, &old, t0()).await.unwrap().is_empty());
    assert!(claim(&db, &new, t0() + 1_000).await.unwrap().is_empty());
    // Five idle minutes: no claim, only what idle claimers tell every quarter lease.
    let tell = |types: &'static [&'static str], now: i64| {
        let builds = vec![("h".to_owned(), types.iter().map(|t| t.to_string()).collect::<Vec<_>>())];
        let db = db.clone();
        async move {
            job(&db, move |tx| {
                Box::pin(async move { Ok(deliveries::builds_standing_by(tx, now, POLICY.lease, &builds).await?) })
            })
            .await
            .unwrap()
        }
    };
    for step in 1..=40 {
        let now = t0() + 1_000 + step * 7_500;
        assert!(tell(&["MovieDeleted"], now).await.contains_key("h"), "the old build stands by, told so");
        assert!(tell(&["MovieDeleted", "UserRegistered"], now).await.is_empty());
    }
    // The old build's claim comes first after the quiet: still standing by.
    enqueue(&db, 2).await;
    let now = t0() + 301_000 + 1_000;
    assert!(matches!(claim(&db, &old, now).await, Err(Error::Claim(ClaimError::StandingBy(_)))));
    assert_eq!(claim(&db, &new, now).await.unwrap().len(), 2);

    // Not heard from for four leases, the new build counts as gone (rolled back); heard from
    // again, it is still the one first heard from last.
    let gone = now + 120_001;
    assert!(tell(&["MovieDeleted"], gone).await.is_empty(), "the old build claims again");
    assert!(tell(&["MovieDeleted", "UserRegistered"], gone + 1).await.is_empty());
    assert!(tell(&["MovieDeleted"], gone + 2).await.contains_key("h"), "and stands by again");
}

#[tokio::test]
async fn leases_are_renewed_by_live_owners_and_taken_over_from_dead_ones() {
    let (_dir, db) = open().await;
    register(&db, &["a"], t0()).await;
    enqueue(&db, 2).await;
    let a = request("a", &["MovieDeleted", "UserRegistered"], "p1#x");
    let held = claim(&db, &a, t0()).await.unwrap();
    assert_eq!(held.len(), 2);
    // The owner renews the first at 25 s; at 31 s only the second is taken over.
    let keys = vec![(held[0].key.clone(), held[0].token)];
    let lost = job(&db, move |tx| Box::pin(async move { Ok(deliveries::renew(tx, "a", &keys, t0() + 25_000).await?) }))
        .await
        .unwrap();
    assert!(lost.is_empty());
    let other = request("a", &["MovieDeleted", "UserRegistered"], "p2#y");
    let taken = claim(&db, &other, t0() + 31_000).await.unwrap();
    assert_eq!(taken.iter().map(|d| d.key.clone()).collect::<Vec<_>>(), vec![held[1].key.clone()]);
    assert_eq!(taken[0].attempt, 2, "the dead owner's run counts as an attempt");
    // The old owner of the second is late: its settle and renewal change nothing.
    let late = settle(&db, "a", vec![outcome(&held[1], DeliveryOutcome::Done)], t0() + 32_000).await;
    assert_eq!(late.lost, vec![held[1].key.clone()]);
    let keys = vec![(held[1].key.clone(), held[1].token)];
    let lost = job(&db, move |tx| Box::pin(async move { Ok(deliveries::renew(tx, "a", &keys, t0() + 32_000).await?) }))
        .await
        .unwrap();
    assert_eq!(lost, vec![held[1].key.clone()]);
    assert_eq!(settle(&db, "a", vec![outcome(&taken[0], DeliveryOutcome::Done)], t0() + 33_000).await.settled, 1);
}

/// What the claim `claim` gets back of what its owner's calls `unanswered` claimed.
async fn resume_within(db: &Database, claim: HandlerClaim, unanswered: &[u64], now: i64) -> Vec<ClaimedDelivery> {
    let unanswered = unanswered.to_vec();
    job(db, move |tx| Box::pin(async move { Ok(deliveries::resume(tx, &claim, &unanswered, now).await?) }))
        .await
        .unwrap()
}

/// The same for call `call` of `owner` for `handler`, with room for everything.
async fn resume(
    db: &Database,
    (handler, owner): (&str, &str),
    unanswered: &[u64],
    call: u64,
    now: i64,
) -> Vec<ClaimedDelivery> {
    resume_within(db, HandlerClaim { call, ..request(handler, &[], owner) }, unanswered, now).await
}

#[tokio::test]
async fn deliveries_whose_answer_was_lost_are_handed_back_to_their_owner_only_while_it_holds_them() {
    let (_dir, db) = open().await;
    register(&db, &["a"], t0()).await;
    enqueue(&db, 3).await;
    let types = ["MovieDeleted", "UserRegistered"];
    let lost = claim(&db, &HandlerClaim { call: 7, ..request("a", &types, "p1#x") }, t0()).await.unwrap();
    assert_eq!(lost.len(), 3);
    // The owner never heard of them. The first one's lease runs out and another owner takes it
    // over at 31 s; the other two are still live (renewed at 20 s, so they need not be asked
    // for back within the lease of the claim).
    let keys = vec![(lost[1].key.clone(), lost[1].token), (lost[2].key.clone(), lost[2].token)];
    job(&db, move |tx| Box::pin(async move { Ok(deliveries::renew(tx, "a", &keys, t0() + 20_000).await?) }))
        .await
        .unwrap();
    let taken = claim(&db, &request("a", &types, "p2#y"), t0() + 31_000).await.unwrap();
    assert_eq!(taken.iter().map(|d| &d.key).collect::<Vec<_>>(), vec![&lost[0].key]);

    assert!(resume(&db, ("a", "p2#y"), &[7], 8, t0() + 32_000).await.is_empty(), "another owner gets nothing");
    assert!(resume(&db, ("b", "p1#x"), &[7], 8, t0() + 32_000).await.is_empty(), "nor does another handler");
    assert!(resume(&db, ("a", "p1#x"), &[6, 8], 8, t0() + 32_000).await.is_empty(), "nor another call");
    assert!(resume(&db, ("a", "p1#x"), &[0], 8, t0() + 32_000).await.is_empty(), "nor a call without an id");
    let one_row = HandlerClaim { call: 8, max_rows: 1, ..request("a", &types, "p1#x") };
    assert_eq!(resume_within(&db, one_row, &[7], t0() + 31_500).await, lost[1..2].to_vec(), "no more rows than asked");
    let one = lost[2].payload.len() + reelay_outbox::queue::CLAIM_ROW_OVERHEAD;
    let small = HandlerClaim { call: 9, max_bytes: one - 1, ..request("a", &types, "p1#x") };
    assert!(resume_within(&db, small, &[7], t0() + 31_500).await.is_empty(), "nor more bytes than the answer carries");
    let fits = HandlerClaim { call: 9, max_bytes: one, ..request("a", &types, "p1#x") };
    assert_eq!(resume_within(&db, fits, &[7], t0() + 31_500).await, lost[2..3].to_vec());
    // The answers of calls 8 and 9 were lost too: each delivery comes back once more, under 10.
    let back = resume(&db, ("a", "p1#x"), &[7, 8, 9], 10, t0() + 32_000).await;
    assert_eq!(back, lost[1..].to_vec(), "the ones still its own, as they were handed (payloads too)");
    assert!(resume(&db, ("a", "p1#x"), &[7, 8, 9], 11, t0() + 32_000).await.is_empty(), "handed back: moved on");
    // Renewed by the hand-back: not taken over at 51 s (20 s after their renewal, 31 s after
    // the one before it).
    assert!(claim(&db, &request("a", &types, "p3#z"), t0() + 51_000).await.unwrap().is_empty());
    assert_eq!(
        settle(&db, "a", back.iter().map(|d| outcome(d, DeliveryOutcome::Done)).collect(), t0() + 52_000).await.settled,
        2
    );
    assert!(resume(&db, ("a", "p1#x"), &[10], 12, t0() + 53_000).await.is_empty(), "settled ones are not handed back");
}

#[tokio::test]
async fn a_restarted_instance_takes_back_its_predecessors_claims_at_once() {
    let (_dir, db) = open().await;
    register(&db, &["a", "b"], t0()).await;
    enqueue(&db, 3).await;
    let types = ["MovieDeleted", "UserRegistered"];
    let dead = claim(&db, &request("a", &types, "host:/data#1111"), t0()).await.unwrap();
    let other = claim(&db, &request("b", &types, "otherhost:/data#2222"), t0()).await.unwrap();
    assert_eq!((dead.len(), other.len()), (3, 3));
    let released = job(&db, |tx| {
        Box::pin(async move {
            Ok(deliveries::release_instance(tx, "host:/data", "host:/data#3333", t0() + 1_000, Some(8)).await?)
        })
    })
    .await
    .unwrap();
    assert_eq!(released, 3, "only the predecessor's claims");
    let again = claim(&db, &request("a", &types, "host:/data#3333"), t0() + 1_000).await.unwrap();
    assert_eq!(again.len(), 3, "well before the 30 s lease");
    assert!(again.iter().all(|d| d.attempt == 2), "the dead run's attempt counts (db)");
    assert!(
        claim(&db, &request("b", &types, "host:/data#3333"), t0() + 1_000).await.unwrap().is_empty(),
        "another instance's live claims are untouched"
    );
}

#[tokio::test]
async fn cursors_start_at_the_floor_then_at_the_newest_row_and_unknown_handlers_are_refused() {
    let (_dir, db) = open().await;
    enqueue(&db, 4).await;
    // The first handlers of a fresh database get everything from the start.
    assert_eq!(register(&db, &["a"], t0()).await, vec!["a".to_owned()]);
    assert!(register(&db, &["a"], t0()).await.is_empty(), "registering again changes nothing");
    let types = ["MovieDeleted", "UserRegistered"];
    assert_eq!(claim(&db, &request("a", &types, "p#1"), t0()).await.unwrap().len(), 4);
    // A handler added later gets the events written from then on.
    register(&db, &["a", "late"], t0()).await;
    enqueue(&db, 2).await;
    assert_eq!(claim(&db, &request("late", &types, "p#1"), t0()).await.unwrap().len(), 2);
    let unknown = claim(&db, &request("stranger", &types, "p#1"), t0()).await.unwrap_err();
    assert!(matches!(unknown, Error::Claim(ClaimError::UnknownHandler(_))), "{unknown:?}");
}

#[tokio::test]
async fn claims_stay_within_the_answer_size() {
    let (_dir, db) = open().await;
    register(&db, &["a"], t0()).await;
    enqueue(&db, 50).await;
    let mut small = request("a", &["MovieDeleted", "UserRegistered"], "p#1");
    small.max_bytes = 10 * (deliveries_overhead() + 64);
    let mut total = 0;
    loop {
        let claimed = claim(&db, &small, t0()).await.unwrap();
        if claimed.is_empty() {
            break;
        }
        let bytes: usize = claimed.iter().map(|d| d.payload.len() + deliveries_overhead()).sum();
        assert!(bytes <= small.max_bytes, "{bytes} > {}", small.max_bytes);
        total += claimed.len();
    }
    assert_eq!(total, 50);
}

/// Handlers claimed for in one answer share its size: together they never hand out more than
/// it holds, and what did not fit comes in the next claims, each row once to each handler.
#[tokio::test]
async fn handlers_sharing_one_answer_stay_within_it_together() {
    let (_dir, db) = open().await;
    register(&db, &["a", "b", "c"], t0()).await;
    enqueue(&db, 40).await;
    let limit = 10 * (deliveries_overhead() + 64);
    let mut handed: Vec<Vec<String>> = vec![Vec::new(); 3];
    let mut shared_answers = 0;
    for round in 0.. {
        assert!(round < 100, "the handlers never caught up");
        let shared = deliveries::SharedAnswer::new(limit);
        let requests: Vec<HandlerClaim> = ["a", "b", "c"]
            .map(|h| HandlerClaim {
                max_bytes: limit,
                shared: Some(shared.clone()),
                ..request(h, &["MovieDeleted", "UserRegistered"], "p#1")
            })
            .into_iter()
            .collect();
        let answers =
            job(&db, move |tx| Box::pin(async move { Ok(deliveries::claim_many(tx, t0(), POLICY, &requests).await?) }))
                .await
                .unwrap();
        let claimed: Vec<Vec<ClaimedDelivery>> = answers.into_iter().map(Result::unwrap).collect();
        if claimed.iter().all(Vec::is_empty) {
            break;
        }
        let bytes: usize = claimed.iter().flatten().map(|d| d.payload.len() + deliveries_overhead()).sum();
        assert!(bytes <= limit, "one answer of {bytes} bytes, its limit {limit}");
        shared_answers += usize::from(claimed.iter().filter(|c| !c.is_empty()).count() > 1);
        for (keys, claimed) in handed.iter_mut().zip(claimed) {
            keys.extend(claimed.into_iter().map(|d| d.key));
        }
    }
    assert!(shared_answers > 0, "no answer carried more than one handler's deliveries");
    for keys in &handed {
        let distinct: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!((keys.len(), distinct.len()), (40, 40), "each handler gets each event once");
    }
}

/// A claim whose insert meets rows that exist already hands over only the rows it created, and
/// a settlement with a stale token among live ones reports just that one lost: the uncommon
/// paths that read back what a statement changed.
#[tokio::test]
async fn claims_and_settlements_that_meet_other_rows_report_only_their_own() {
    let (_dir, db) = open().await;
    register(&db, &["a"], t0()).await;
    enqueue(&db, 4).await;
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT event_id FROM event_queue ORDER BY id").fetch_all(&db.reads).await.unwrap();
    let done_before = keys[1].clone();
    // As an upgraded database has it: the second event done for `a` before its cursor existed.
    put_ledger_row(
        &db,
        "INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES (?1, 'a', 'done', ?2, ?2)",
        done_before,
    )
    .await;
    let a = request("a", &["MovieDeleted", "UserRegistered"], "p#1");
    let claimed = claim(&db, &a, t0()).await.unwrap();
    let handed: Vec<&str> = claimed.iter().map(|d| d.key.as_str()).collect();
    assert_eq!(handed, [&keys[0], &keys[2], &keys[3]], "the row done before is passed");
    let mut settlements: Vec<Settlement> = claimed.iter().map(|d| outcome(d, DeliveryOutcome::Done)).collect();
    settlements[1].token -= 1;
    let settled = settle(&db, "a", settlements, t0() + 1).await;
    assert_eq!((settled.settled, settled.lost), (2, vec![keys[2].clone()]));
    assert_eq!(state(&db, &keys[2], "a").await.0, "in_progress", "a stale token changes nothing");
    assert_eq!(state(&db, &keys[3], "a").await.0, "done");
}

/// As an upgraded database can have it: an event past the handler's new cursor already has a
/// claim from before (never attempted), whose owner stopped renewing it. The claim that takes
/// it over hands it once, not a second time as a new row.
#[tokio::test]
async fn an_expired_claim_from_before_the_cursor_is_handed_once() {
    let (_dir, db) = open().await;
    register(&db, &["a"], t0()).await;
    enqueue(&db, 2).await;
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT event_id FROM event_queue ORDER BY id").fetch_all(&db.reads).await.unwrap();
    put_ledger_row(
        &db,
        "INSERT INTO processed_events (event_id, handler, status, started_at, renewed_at, owner, attempts) \
         VALUES (?1, 'a', 'in_progress', ?2, ?2, 'gone#1', 0)",
        keys[1].clone(),
    )
    .await;
    let later = t0() + 2 * POLICY.lease.as_millis() as i64;
    let claimed = claim(&db, &request("a", &["MovieDeleted", "UserRegistered"], "p#1"), later).await.unwrap();
    let mut handed: Vec<&str> = claimed.iter().map(|d| d.key.as_str()).collect();
    handed.sort_unstable();
    let mut want = vec![keys[0].as_str(), keys[1].as_str()];
    want.sort_unstable();
    assert_eq!(handed, want, "each event once");
}

fn deliveries_overhead() -> usize {
    reelay_outbox::queue::CLAIM_ROW_OVERHEAD
}

async fn purge(db: &Database, cursors: bool) -> u64 {
    job(db, move |tx| {
        Box::pin(async move { Ok(reelay_outbox::queue::purge_finished(tx, i64::MAX, cursors, 500).await?) })
    })
    .await
    .unwrap()
}

async fn act(db: &Database, target: Target, action: Action) -> Acted {
    job(db, move |tx| Box::pin(async move { Ok(dead_letters::act(tx, &target, action, "ops", t0()).await?) }))
        .await
        .unwrap()
}

async fn outbox_ids(db: &Database) -> Vec<i64> {
    sqlx::query_scalar("SELECT id FROM event_queue ORDER BY id").fetch_all(&db.reads).await.unwrap()
}

/// Retention stops at the lowest cursor: a handler that looked at the first two rows (done) and
/// one that looked at none hold the rest back, and a purge past every cutoff deletes nothing
/// of them, the first two only once both handlers are past them.
#[tokio::test]
async fn retention_stops_at_the_lowest_cursor() {
    let (_dir, db) = open().await;
    register(&db, &["a", "b"], t0()).await;
    enqueue(&db, 4).await;
    let mut two = request("a", &["MovieDeleted", "UserRegistered"], "p#1");
    two.max_rows = 2;
    let claimed = claim(&db, &two, t0()).await.unwrap();
    assert_eq!(claimed.len(), 2);
    settle(&db, "a", claimed.iter().map(|d| outcome(d, DeliveryOutcome::Done)).collect(), t0()).await;
    assert_eq!(purge(&db, true).await, 0, "b has looked at nothing");
    let mut b = request("b", &["MovieDeleted", "UserRegistered"], "p#2");
    b.max_rows = 2;
    let claimed = claim(&db, &b, t0()).await.unwrap();
    settle(&db, "b", claimed.iter().map(|d| outcome(d, DeliveryOutcome::Done)).collect(), t0()).await;
    assert_eq!(purge(&db, true).await, 2, "the rows both are done with");
    assert_eq!(outbox_ids(&db).await.len(), 2, "the two no handler looked at stay");
}

/// Retention deletes only what every handler is finished with; a dead letter keeps its event
/// until it is replayed (once, however often it is asked) and handled, or discarded.
#[tokio::test]
async fn retention_keeps_open_and_dead_letters_and_replays_happen_once() {
    let (_dir, db) = open().await;
    register(&db, &["a"], t0()).await;
    enqueue(&db, 4).await;
    let a = request("a", &["MovieDeleted", "UserRegistered"], "p1#x");
    let claimed = claim(&db, &a, t0()).await.unwrap();
    let failed = DeliveryOutcome::Failed { error: "boom".into(), terminal: true };
    settle(
        &db,
        "a",
        vec![
            outcome(&claimed[0], DeliveryOutcome::Done),
            outcome(&claimed[1], DeliveryOutcome::Done),
            outcome(&claimed[2], failed),
        ],
        t0(),
    )
    .await;
    // claimed[3] stays in progress.
    let ids = outbox_ids(&db).await;
    assert_eq!(purge(&db, true).await, 2, "the two done rows go");
    assert_eq!(outbox_ids(&db).await, ids[2..].to_vec(), "the dead letter's and the open delivery's rows stay");
    assert_eq!(purge(&db, false).await, 0, "on nats only published (done) rows are finished");

    let dead = claimed[2].key.clone();
    let target = Target::Events { event_ids: vec![dead.clone()], handler: None };
    let first = act(&db, target.clone(), Action::Replay { republish: false }).await;
    let second = act(&db, target.clone(), Action::Replay { republish: false }).await;
    assert_eq!(first.changed, vec![(dead.clone(), "a".to_owned())]);
    assert!(second.changed.is_empty() && second.unchanged == vec![(dead.clone(), String::new())], "{second:?}");
    let audit: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dead_letter_actions").fetch_one(&db.reads).await.unwrap();
    assert_eq!(audit, 1, "one replay, recorded once");
    assert_eq!(state(&db, &dead, "a").await, ("retry".into(), 0), "due again with fresh attempts");
    let again = claim(&db, &a, t0() + 1).await.unwrap();
    assert_eq!(again.iter().map(|d| (d.key.as_str(), d.attempt)).collect::<Vec<_>>(), vec![(dead.as_str(), 1)]);
    settle(&db, "a", vec![outcome(&again[0], DeliveryOutcome::Done)], t0() + 2).await;
    assert_eq!(purge(&db, true).await, 1, "handled after the replay, its row goes");

    // Discarding: never delivered again, and the event may go.
    settle(&db, "a", vec![outcome(&claimed[3], DeliveryOutcome::Failed { error: "no".into(), terminal: true })], t0())
        .await;
    let discarded = act(&db, Target::AllOf { handler: "a".into(), after: String::new() }, Action::Discard).await;
    assert_eq!(discarded.changed.len(), 1);
    assert_eq!(state(&db, &claimed[3].key, "a").await.0, "discarded");
    assert!(claim(&db, &a, t0() + 10_000_000).await.unwrap().is_empty(), "a discarded delivery is not claimed");
    assert_eq!(purge(&db, true).await, 1);
    assert!(outbox_ids(&db).await.is_empty());
}

/// Where every handler stands (read at each scrape, in one walk of the backlog for all of them)
/// is what counting each handler's rows apart gives: with cursors tied, before rows retention
/// took, inside a gap, at the newest row and past it, over rows of every status.
#[tokio::test]
async fn every_handlers_standing_is_what_counting_its_own_rows_gives() {
    let (_dir, db) = open().await;
    let handlers = ["a", "b", "c", "d", "e", "f"];
    register(&db, &handlers, t0()).await;
    enqueue(&db, 60).await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids, (1..=60).collect::<Vec<i64>>());
    job(&db, |tx| {
        Box::pin(async move {
            // Written 10 ms apart, of every status an outbox row can have.
            sqlx::query(
                "UPDATE event_queue SET created_at = ? + 10 * id, status = CASE id % 4 \
                     WHEN 0 THEN 'pending' WHEN 1 THEN 'processing' WHEN 2 THEN 'done' ELSE 'dead_lettered' END",
            )
            .bind(t0())
            .execute(tx.conn())
            .await?;
            for sql in [
                // Retention took the first ten; three in the middle are gone too.
                "DELETE FROM event_queue WHERE id <= 10 OR id BETWEEN 31 AND 33",
                "UPDATE handler_cursors SET position = CASE handler \
                     WHEN 'a' THEN 0 WHEN 'b' THEN 21 WHEN 'c' THEN 21 WHEN 'd' THEN 32 WHEN 'e' THEN 60 ELSE 160 END",
            ] {
                sqlx::query(sql).execute(tx.conn()).await?;
            }
            Ok(())
        })
    })
    .await
    .unwrap();

    let mut conn = db.reads.acquire().await.unwrap();
    let stats = deliveries::stats(&mut conn, true).await.unwrap();
    assert_eq!(stats.iter().map(|h| h.handler.as_str()).collect::<Vec<_>>(), handlers);
    for h in &stats {
        let (count, first): (i64, Option<i64>) = sqlx::query_as(
            "SELECT COUNT(*), MIN(created_at) FROM event_queue \
                 WHERE id > (SELECT position FROM handler_cursors WHERE handler = ?)",
        )
        .bind(&h.handler)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        assert_eq!((h.behind as i64, h.first_behind_at), (count, first), "{}", h.handler);
    }
    let behind: Vec<u64> = stats.iter().map(|h| h.behind).collect();
    assert_eq!(behind, [47, 36, 36, 27, 0, 0]);
    assert_eq!(stats[3].first_behind_at, Some(t0() + 340), "d: the gap's last row is behind its cursor");
    // On nats the cursors never move, and nothing is counted after them.
    let on_nats = deliveries::stats(&mut conn, false).await.unwrap();
    assert!(on_nats.iter().all(|h| h.behind == 0), "{on_nats:?}");
    let open = |s: &[deliveries::HandlerStats]| s.iter().map(|h| (h.in_progress, h.retrying)).collect::<Vec<_>>();
    assert_eq!(open(&on_nats), open(&stats), "its open deliveries are counted the same");

    // The operator's view: a's oldest is its first row after the cursor (id 11); the outbox's
    // oldest due is the first pending row after the lowest cursor (id 12).
    let now = t0() + 10_000;
    let status = reelay_outbox::inspect::status(&mut conn, now, true).await.unwrap();
    let a = &status.handlers[0];
    assert_eq!((a.pending, a.oldest_age_ms), (47, now - (t0() + 110)));
    assert_eq!(status.handlers[4].oldest_age_ms, 0, "e has nothing waiting");
    assert_eq!(status.outbox.oldest_due_age_ms, now - (t0() + 120));
}

/// On nats a replay is an outbox row of its own, for one handler, with a message id of its own.
#[tokio::test]
async fn a_nats_replay_is_a_row_for_one_handler() {
    let (_dir, db) = open().await;
    register(&db, &["a"], t0()).await;
    enqueue(&db, 1).await;
    let key: String = sqlx::query_scalar("SELECT event_id FROM event_queue").fetch_one(&db.reads).await.unwrap();
    let key2 = key.clone();
    // As a nats handler's last failure leaves it: a dead letter in the ledger.
    put_ledger_row(
        &db,
        "INSERT INTO processed_events (event_id, handler, status, started_at, attempts, last_error) \
         VALUES (?1, 'a', 'dead_lettered', ?2, 8, 'exhausted')",
        key2,
    )
    .await;
    let target = Target::AllOf { handler: "a".into(), after: String::new() };
    assert_eq!(act(&db, target.clone(), Action::Replay { republish: true }).await.changed.len(), 1);
    assert!(act(&db, target, Action::Replay { republish: true }).await.changed.is_empty(), "once");
    let rows: Vec<(String, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT event_id, replay_of, replay_handler FROM event_queue ORDER BY id")
            .fetch_all(&db.reads)
            .await
            .unwrap();
    assert_eq!(rows.len(), 2, "one replay row");
    assert_eq!(rows[1], (format!("{key}:replay:1:a"), Some(key.clone()), Some("a".to_owned())));
}

/// A handler far behind on rows it does not take reaches its own in one claim, not one scan
/// window per call (each empty answer would cost the claimer a long-poll).
#[tokio::test]
async fn a_cursor_behind_thousands_of_other_rows_catches_up_in_one_claim() {
    let (_dir, db) = open().await;
    register(&db, &["wrap"], t0()).await;
    enqueue(&db, 3000).await;
    job(&db, |tx| {
        Box::pin(async move {
            let payload = v1::event::Payload::WrapUpRequested(v1::WrapUpRequested {
                wrap_up_id: "w1".into(),
                ..Default::default()
            });
            enqueue_events(tx, vec![NewEvent::new(1, payload)]).await.expect("a small event fits");
            Ok(())
        })
    })
    .await
    .unwrap();
    let claimed = claim(&db, &request("wrap", &["WrapUpRequested"], "p#1"), t0()).await.unwrap();
    assert_eq!(claimed.len(), 1, "the one WrapUpRequested behind 3,000 other rows");
}

/// Several handlers' claims in one job (as the write service merges concurrent claims) hand
/// each request exactly what claiming for it alone, one after the other, hands it: handlers at
/// different positions, a due retry, the same handler twice and an unknown handler. Settling
/// them together marks each (event, handler) once and reports a stale token as lost.
#[tokio::test]
async fn claims_of_many_handlers_in_one_job_equal_one_claim_each() {
    let all = ["MovieDeleted", "UserRegistered"];
    let asked = |max: u32| {
        let mut requests = vec![
            request("x", &["MovieDeleted"], "p#1"),
            request("y", &all, "p#1"),
            request("z", &["UserRegistered"], "p#1"),
            request("y", &all, "p#2"),
            request("w", &all, "p#1"),
        ];
        requests[1].max_rows = max;
        requests
    };
    // The same history on two databases: y is ahead of x and z, and has a retry due.
    let mut answers = Vec::new();
    for merged in [true, false] {
        let (dir, db) = open().await;
        register(&db, &["x", "y", "z"], t0()).await;
        enqueue(&db, 40).await;
        let mut first = request("y", &all, "p#1");
        first.max_rows = 5;
        let early = claim(&db, &first, t0()).await.unwrap();
        let failed = outcome(&early[0], DeliveryOutcome::Failed { error: "boom".into(), terminal: false });
        let done: Vec<Settlement> = early[1..].iter().map(|d| outcome(d, DeliveryOutcome::Done)).collect();
        settle(&db, "y", [vec![failed], done].concat(), t0()).await;
        let now = t0() + 60_000;
        let claimed: Vec<Result<Vec<ClaimedDelivery>, String>> = if merged {
            let requests = asked(7);
            job(&db, move |tx| Box::pin(async move { Ok(deliveries::claim_many(tx, now, POLICY, &requests).await?) }))
                .await
                .unwrap()
                .into_iter()
                .map(|answer| answer.map_err(|e| e.to_string()))
                .collect()
        } else {
            let mut one_by_one = Vec::new();
            for request in asked(7) {
                one_by_one.push(claim(&db, &request, now).await.map_err(|e| match e {
                    Error::Claim(e) => e.to_string(),
                    other => panic!("{other:?}"),
                }));
            }
            one_by_one
        };
        // Event ids differ between the databases; rows, types and attempts do not.
        type Shape = Result<Vec<(i64, String, u32)>, bool>;
        let shape: Vec<Shape> = claimed
            .iter()
            .map(|answer| match answer {
                Ok(deliveries) => Ok(deliveries.iter().map(|d| (d.row_id, d.event_type.clone(), d.attempt)).collect()),
                Err(error) => Err(error.contains("is not registered")),
            })
            .collect();
        let cursors: Vec<(String, i64)> =
            sqlx::query_as("SELECT handler, position FROM handler_cursors ORDER BY handler")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        if merged {
            // Settle x's and both of y's answers together, plus one of x's under a stale token.
            let x: Vec<Settlement> =
                claimed[0].as_ref().unwrap().iter().map(|d| outcome(d, DeliveryOutcome::Done)).collect();
            let mut stale = x[0].clone();
            stale.token -= 1;
            let y: Vec<Settlement> = [&claimed[1], &claimed[3]]
                .iter()
                .flat_map(|a| a.as_ref().unwrap().iter().map(|d| outcome(d, DeliveryOutcome::Done)))
                .collect();
            let (xs, ys) = (x.clone(), y.clone());
            let settled = job(&db, move |tx| {
                Box::pin(async move {
                    let requests: [(&str, &[Settlement]); 3] =
                        [("x", &xs), ("y", &ys), ("x", std::slice::from_ref(&stale))];
                    Ok(deliveries::settle_many(tx, &requests, now, POLICY).await?)
                })
            })
            .await
            .unwrap();
            assert_eq!(settled[0].settled, x.len());
            assert_eq!(settled[1].settled, y.len());
            assert_eq!(settled[2].lost, vec![x[0].key.clone()], "a stale token changes nothing");
            for s in x.iter() {
                assert_eq!(state(&db, &s.key, "x").await.0, "done");
            }
            for s in y.iter() {
                assert_eq!(state(&db, &s.key, "y").await.0, "done");
            }
        }
        answers.push((shape, cursors));
        drop(dir);
    }
    let (merged, one_by_one) = (&answers[0], &answers[1]);
    assert_eq!(merged, one_by_one);
    let shape = &merged.0;
    assert_eq!(shape[0].as_ref().unwrap().len(), 20, "x: every MovieDeleted");
    let y = shape[1].as_ref().unwrap();
    assert_eq!(y.len(), 7);
    assert_eq!(y[0].2, 2, "y's due retry comes first, on its second attempt");
    assert_eq!(shape[2].as_ref().unwrap().len(), 20, "z: every UserRegistered");
    assert_eq!(shape[3].as_ref().unwrap().len(), 40 - 5 - 6, "y's second request: the rest");
    assert_eq!(shape[4], Err(true), "w is not registered");
}

/// Handlers whose positions are close share one read of the outbox, from the lowest; one far
/// behind is read apart. With budgets smaller than what there is, each still gets exactly the
/// rows and cursor that claiming for it alone gives.
#[tokio::test]
async fn handlers_at_near_and_far_positions_claimed_together_get_their_own_rows() {
    let all = ["MovieDeleted", "UserRegistered"];
    let mut outcomes = Vec::new();
    for merged in [true, false] {
        let (dir, db) = open().await;
        register(&db, &["near", "nearer", "far", "types"], t0()).await;
        enqueue(&db, 3000).await;
        // Move `nearer` 8 rows and `far` 2,500 rows on; `near` and `types` stay at the start.
        for (handler, rows) in [("nearer", 8), ("far", 2500)] {
            let mut ahead = request(handler, &all, "p#1");
            ahead.max_rows = rows;
            claim(&db, &ahead, t0()).await.unwrap();
        }
        let requests: Vec<HandlerClaim> = [("near", &all[..]), ("nearer", &all), ("far", &all), ("types", &all[1..])]
            .into_iter()
            .map(|(handler, types)| HandlerClaim { max_rows: 5, ..request(handler, types, "p#2") })
            .collect();
        let claimed: Vec<Vec<ClaimedDelivery>> = if merged {
            job(&db, move |tx| Box::pin(async move { Ok(deliveries::claim_many(tx, t0(), POLICY, &requests).await?) }))
                .await
                .unwrap()
                .into_iter()
                .map(Result::unwrap)
                .collect()
        } else {
            let mut one_by_one = Vec::new();
            for request in &requests {
                one_by_one.push(claim(&db, request, t0()).await.unwrap());
            }
            one_by_one
        };
        let rows: Vec<Vec<i64>> = claimed.iter().map(|c| c.iter().map(|d| d.row_id).collect()).collect();
        let cursors: Vec<(String, i64)> =
            sqlx::query_as("SELECT handler, position FROM handler_cursors ORDER BY handler")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        outcomes.push((rows, cursors));
        drop(dir);
    }
    let ((rows, cursors), (alone, alone_cursors)) = (&outcomes[0], &outcomes[1]);
    assert_eq!(rows, alone);
    // The shared read may move `types` past a row of the other type that claiming alone had not
    // yet looked at (11): never past one of its own (12).
    let at = |cursors: &[(String, i64)], handler: &str| cursors.iter().find(|c| c.0 == handler).unwrap().1;
    for (cursors, types) in [(cursors, 10..=11), (alone_cursors, 10..=10)] {
        assert_eq!([at(cursors, "near"), at(cursors, "nearer"), at(cursors, "far")], [5, 13, 2505]);
        assert!(types.contains(&at(cursors, "types")), "{cursors:?}");
    }
    assert_eq!(rows[0], vec![1, 2, 3, 4, 5], "near: from the start");
    assert_eq!(rows[1], vec![9, 10, 11, 12, 13], "nearer: after its 8");
    assert_eq!(rows[2], vec![2501, 2502, 2503, 2504, 2505], "far: after its 2,500");
    assert!(rows[3].iter().all(|id| id % 2 == 0) && rows[3].len() == 5, "types: its own type only: {:?}", rows[3]);
}

/// Every dead letter of a handler is taken a batch at a time, by event id: a batch is at most
/// `ALL_OF_BATCH`, the next starts after the last one's greatest id, and together they are
/// each dead letter once (another handler's are not touched).
#[tokio::test]
async fn every_dead_letter_of_a_handler_is_taken_a_batch_at_a_time() {
    let (_dir, db) = open().await;
    let total = dead_letters::ALL_OF_BATCH * 2 + 7;
    job(&db, move |tx| {
        Box::pin(async move {
            for n in 0..total {
                for handler in ["a", "b"] {
                    sqlx::query(
                        "INSERT INTO processed_events (event_id, handler, status, started_at, attempts, last_error) \
                         VALUES (?, ?, 'dead_lettered', ?, 8, 'exhausted')",
                    )
                    .bind(format!("00000000-0000-7000-8000-{n:012}"))
                    .bind(handler)
                    .bind(t0())
                    .execute(tx.conn())
                    .await?;
                }
            }
            Ok(())
        })
    })
    .await
    .unwrap();
    let (mut after, mut taken, mut sizes) = (String::new(), Vec::new(), Vec::new());
    loop {
        let target = Target::AllOf { handler: "a".into(), after: after.clone() };
        let acted = act(&db, target, Action::Discard).await;
        sizes.push(acted.changed.len());
        let Some(last) = acted.changed.iter().map(|(event_id, _)| event_id.clone()).max() else { break };
        assert!(acted.changed.iter().all(|(event_id, handler)| *event_id > after && handler == "a"));
        taken.extend(acted.changed);
        after = last;
    }
    assert_eq!(sizes, [dead_letters::ALL_OF_BATCH, dead_letters::ALL_OF_BATCH, 7, 0]);
    taken.sort();
    taken.dedup();
    assert_eq!(taken.len(), total, "each once");
    let left: Vec<(String, i64)> = sqlx::query_as(
        "SELECT handler, COUNT(*) FROM processed_events WHERE status = 'dead_lettered' GROUP BY handler",
    )
    .fetch_all(&db.reads)
    .await
    .unwrap();
    assert_eq!(left, [("b".to_owned(), total as i64)]);
}
