//! The outbox queue and the ledger against a real SQLite file, with the clock injected.

use std::time::Duration;

use futures_util::future::BoxFuture;
use reelay_contracts::v1;
use reelay_domain::{NewEvent, retry_backoff};
use reelay_outbox::ledger::{self, ClaimOutcome, GivenUp, GivenUpOutcome, LedgerKey, LedgerPolicy, OwnedKey};
use reelay_outbox::queue::{self, ClaimLimits, FailedRow, Published, QueuePolicy, RowClaim};
use reelay_outbox::{CommitError, Database, DbConfig, WriteTx, enqueue_events};
use sqlx::Row;

mod common;
use common::t0;

#[derive(Debug)]
enum Error {
    Commit(#[allow(dead_code, reason = "shown by Debug when a test fails")] CommitError),
    Sql(#[allow(dead_code, reason = "shown by Debug when a test fails")] sqlx::Error),
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

async fn job<T, F>(db: &Database, work: F) -> T
where
    T: Send + 'static,
    F: for<'t> FnOnce(&'t mut WriteTx) -> BoxFuture<'t, Result<T, sqlx::Error>> + Send + 'static,
{
    db.writer
        .transact::<T, Error, _>("test", move |tx| Box::pin(async move { Ok(work(tx).await?) }))
        .await
        .expect("test job")
}

fn limits() -> ClaimLimits {
    ClaimLimits { owner: "test#1".into(), max_rows: 10, max_bytes: 4 * 1024 * 1024, call: 0 }
}

async fn claim(db: &Database, now: i64, policy: QueuePolicy) -> Vec<queue::ClaimedRow> {
    job(db, move |tx| Box::pin(async move { queue::claim_due(tx, now, policy, &limits()).await })).await
}

async fn open() -> (tempfile::TempDir, Database) {
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(&DbConfig::new(dir.path().join("q.db"))).await.unwrap();
    (dir, db)
}

async fn enqueue(db: &Database, n: usize) {
    job(db, move |tx| {
        Box::pin(async move {
            let events = (0..n)
                .map(|i| {
                    NewEvent::new(i, v1::event::Payload::MovieDeleted(v1::MovieDeleted { movie_id: i.to_string() }))
                })
                .collect();
            enqueue_events(tx, events).await.expect("small events fit");
            Ok(())
        })
    })
    .await
}

async fn row_state(db: &Database, id: i64) -> (String, i64, i64) {
    let r = sqlx::query("SELECT status, attempts, available_at FROM event_queue WHERE id = ?")
        .bind(id)
        .fetch_one(&db.reads)
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

#[tokio::test]
async fn failures_follow_the_backoff_schedule_then_dead_letter() {
    let (_dir, db) = open().await;
    enqueue(&db, 1).await;
    let policy = QueuePolicy { lease: Duration::from_secs(600), max_attempts: 5, ..QueuePolicy::default() };
    let mut now = t0();
    for attempt in 1..=5u32 {
        let claimed = claim(&db, now, policy).await;
        assert_eq!(claimed.len(), 1, "attempt {attempt} is due at {now}");
        assert_eq!(claimed[0].attempts, attempt - 1);
        let row = RowClaim { id: claimed[0].id, claimed_at: claimed[0].claimed_at };
        let failed = FailedRow { row, error: format!("boom {attempt}"), terminal: false };
        let settled = job(&db, move |tx| Box::pin(async move { queue::fail(tx, &[failed], now, policy).await })).await;
        let (status, attempts, available_at) = row_state(&db, row.id).await;
        assert_eq!(attempts, i64::from(attempt));
        if attempt < 5 {
            assert_eq!(status, "pending");
            let wait = retry_backoff(attempt).as_millis() as i64;
            assert_eq!(available_at, now + wait, "attempt {attempt} waits {wait} ms");
            // Not a millisecond early.
            let early = claim(&db, now + wait - 1, policy).await;
            assert!(early.is_empty());
            now += wait;
        } else {
            assert_eq!(status, "dead_lettered");
            assert_eq!(settled.dead_lettered, vec![row.id]);
        }
    }
    let later = claim(&db, now + 3_600_000, policy).await;
    assert!(later.is_empty(), "a dead-lettered row is never claimed again");
    let waits: Vec<u64> = (1..5).map(|a| retry_backoff(a).as_secs()).collect();
    assert_eq!(waits, [5, 10, 20, 40]);
}

#[tokio::test]
async fn defer_spends_no_attempt_and_stale_tokens_change_nothing() {
    let (_dir, db) = open().await;
    enqueue(&db, 3).await;
    let policy = QueuePolicy { lease: Duration::from_secs(600), max_attempts: 3, ..QueuePolicy::default() };
    let claimed = claim(&db, t0(), policy).await;
    assert_eq!(claimed.len(), 3);
    let claims: Vec<RowClaim> = claimed.iter().map(|r| RowClaim { id: r.id, claimed_at: r.claimed_at }).collect();

    // Defer the first until later: no attempt spent, not claimable before then.
    let first = claims[0];
    job(&db, move |tx| Box::pin(async move { queue::defer(tx, &[first], t0() + 60_000).await })).await;
    assert_eq!(row_state(&db, first.id).await, ("pending".into(), 0, t0() + 60_000));
    assert!(claim(&db, t0() + 59_999, policy).await.is_empty());
    // An idle claimer's look agrees: nothing due yet, the deferred row next; then due, and the
    // next due time is not looked up.
    let mut conn = db.reads.acquire().await.unwrap();
    assert_eq!(queue::peek(&mut conn, t0() + 59_999, policy, 0).await.unwrap(), (false, Some(t0() + 60_000)));
    assert_eq!(queue::peek(&mut conn, t0() + 60_000, policy, 0).await.unwrap(), (true, None));
    drop(conn);

    // The second claimer dies; after the lease its row is claimed again under a new token.
    let second = claims[1];
    let reclaimed = claim(&db, t0() + 600_001, policy).await;
    let ids: Vec<i64> = reclaimed.iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![first.id, second.id, claims[2].id], "the deferred row is due, the stale ones reclaimed");
    // The dead claimer's late settle is refused and changes nothing.
    let late_done = Published { row: second, stream_sequence: 0 };
    let late = job(&db, move |tx| Box::pin(async move { queue::complete(tx, &[late_done]).await })).await;
    assert_eq!((late.settled, late.lost), (0, vec![second.id]));
    let stale_fail = FailedRow { row: second, error: "late".into(), terminal: false };
    let late = job(&db, move |tx| Box::pin(async move { queue::fail(tx, &[stale_fail], t0(), policy).await })).await;
    assert_eq!(late.lost, vec![second.id]);
    assert_eq!(row_state(&db, second.id).await.0, "processing");
    // The new owner completes.
    let owner = Published { row: RowClaim { id: second.id, claimed_at: reclaimed[1].claimed_at }, stream_sequence: 7 };
    let done = job(&db, move |tx| Box::pin(async move { queue::complete(tx, &[owner]).await })).await;
    assert_eq!(done.settled, 1);
    let sequence: Option<i64> = sqlx::query_scalar("SELECT stream_sequence FROM event_queue WHERE id = ?")
        .bind(second.id)
        .fetch_one(&db.reads)
        .await
        .unwrap();
    assert_eq!(sequence, Some(7), "the PubAck's sequence is kept for `events explain`");

    let mut conn = db.reads.acquire().await.unwrap();
    let stats = queue::stats(&mut conn, t0() + 600_001, false).await.unwrap();
    assert_eq!((stats.pending, stats.processing, stats.done, stats.dead_lettered), (0, 2, 1, 0));
}

/// A relay's claim gets a whole lease from the writer's restart (or storage fault) before it is
/// handed to another, however old it is: its relay may have published it and be retrying the
/// completion, and another's republish could fall past the broker's duplicate window.
#[tokio::test]
async fn a_relay_claim_gets_a_whole_lease_after_the_writer_restarts() {
    let (_dir, db) = open().await;
    enqueue(&db, 1).await;
    let policy = QueuePolicy { lease: Duration::from_secs(600), ..QueuePolicy::default() };
    assert_eq!(claim(&db, t0(), policy).await.len(), 1);
    let restart = t0() + 3_600_000;
    job(&db, move |tx| {
        Box::pin(async move {
            tx.count_leases_from(restart);
            Ok(())
        })
    })
    .await;
    let counted_from = db.writer.lease_counted_from();
    let mut conn = db.reads.acquire().await.unwrap();
    assert_eq!(queue::peek(&mut conn, restart + 599_999, policy, counted_from).await.unwrap(), (false, None));
    assert_eq!(queue::peek(&mut conn, restart + 600_000, policy, counted_from).await.unwrap(), (true, None));
    drop(conn);
    assert!(claim(&db, restart + 599_999, policy).await.is_empty(), "held for a lease from the restart");
    assert_eq!(claim(&db, restart + 600_000, policy).await.len(), 1, "then taken over");
}

fn key(event: &str, handler: &str) -> LedgerKey {
    LedgerKey { event_id: event.into(), handler: handler.into() }
}

#[tokio::test]
async fn ledger_claims_are_exclusive_owned_and_expire() {
    let (_dir, db) = open().await;
    let policy = LedgerPolicy { lease: Duration::from_secs(1800), retention: Duration::from_secs(30 * 86_400) };
    let keys = vec![key("e1", "search"), key("e1", "posters"), key("e2", "search")];

    let k = keys.clone();
    let first =
        job(&db, move |tx| Box::pin(async move { ledger::claim(tx, &k, false, "w1#a", t0(), policy).await })).await;
    assert_eq!(first, vec![ClaimOutcome::Acquired(t0()); 3]);

    // A second worker a minute later: held until the lease ends.
    let k = keys.clone();
    let second =
        job(&db, move |tx| Box::pin(async move { ledger::claim(tx, &k, false, "w2#a", t0() + 60_000, policy).await }))
            .await;
    assert_eq!(second, vec![ClaimOutcome::HeldUntil(t0() + 1_800_000); 3]);

    // The owner completes one and releases another; a wrong token is "claim lost".
    let done = vec![OwnedKey { key: keys[0].clone(), token: t0() }, OwnedKey { key: keys[2].clone(), token: t0() - 1 }];
    let owned = job(&db, move |tx| Box::pin(async move { ledger::complete(tx, &done, t0() + 1).await })).await;
    assert_eq!(owned, vec![true, false]);
    let released = vec![OwnedKey { key: keys[1].clone(), token: t0() }];
    assert_eq!(job(&db, move |tx| Box::pin(async move { ledger::release(tx, &released).await })).await, vec![true]);

    // Now: done is skipped, released is free again, the stale one is taken over after the lease.
    let k = keys.clone();
    let later = t0() + 1_800_001;
    let third =
        job(&db, move |tx| Box::pin(async move { ledger::claim(tx, &k, false, "w3#a", later, policy).await })).await;
    assert_eq!(third, vec![ClaimOutcome::Done, ClaimOutcome::Acquired(later), ClaimOutcome::Acquired(later)]);

    // The first owner of e2 wakes up late: its complete and release are refused.
    let stale = vec![OwnedKey { key: keys[2].clone(), token: t0() }];
    let s = stale.clone();
    assert_eq!(
        job(&db, move |tx| Box::pin(async move { ledger::complete(tx, &s, later + 5).await })).await,
        vec![false]
    );
    assert_eq!(job(&db, move |tx| Box::pin(async move { ledger::release(tx, &stale).await })).await, vec![false]);
    let new_owner = vec![OwnedKey { key: keys[2].clone(), token: later }];
    assert_eq!(
        job(&db, move |tx| Box::pin(async move { ledger::complete(tx, &new_owner, later + 6).await })).await,
        vec![true]
    );
}

/// Two deliveries of one event in a batch ask for the same key in one call: only one of them
/// gets the claim (the same token twice would let both run at once), whether the key was free
/// or a stale claim taken over.
#[tokio::test]
async fn a_key_asked_twice_in_one_claim_is_acquired_once() {
    let (_dir, db) = open().await;
    let policy = LedgerPolicy { lease: Duration::from_secs(30), retention: Duration::from_secs(30 * 86_400) };
    let keys = vec![key("e1", "search"), key("e2", "search"), key("e1", "search")];
    let k = keys.clone();
    let first =
        job(&db, move |tx| Box::pin(async move { ledger::claim(tx, &k, false, "w1#a", t0(), policy).await })).await;
    assert_eq!(
        first,
        vec![ClaimOutcome::Acquired(t0()), ClaimOutcome::Acquired(t0()), ClaimOutcome::HeldUntil(t0() + 30_000)]
    );

    // Its owner died: after the lease, the stale claim is taken over once.
    let later = t0() + 60_000;
    let k = vec![key("e1", "search"), key("e1", "search")];
    let taken =
        job(&db, move |tx| Box::pin(async move { ledger::claim(tx, &k, false, "w2#a", later, policy).await })).await;
    assert_eq!(taken, vec![ClaimOutcome::Acquired(later), ClaimOutcome::HeldUntil(later + 30_000)]);
}

/// A claim whose answer its owner never heard: asked again by the same owner with `resume_own`
/// (it runs none of the pairs now), the live claim is handed back with its token and renewed;
/// asked without it, or by another owner, it is held as before.
#[tokio::test]
async fn an_owners_own_live_claim_is_handed_back_when_it_says_it_runs_it_nowhere() {
    let (_dir, db) = open().await;
    let policy = LedgerPolicy { lease: Duration::from_secs(30), retention: Duration::from_secs(30 * 86_400) };
    let claim = |keys: Vec<LedgerKey>, resume_own: bool, owner: &'static str, now: i64| {
        job(&db, move |tx| Box::pin(async move { ledger::claim(tx, &keys, resume_own, owner, now, policy).await }))
    };
    let keys = vec![key("e1", "search"), key("e2", "search")];
    assert_eq!(claim(keys.clone(), false, "w1#a", t0()).await, vec![ClaimOutcome::Acquired(t0()); 2], "answer lost");

    let held = vec![ClaimOutcome::HeldUntil(t0() + 30_000); 2];
    assert_eq!(claim(keys.clone(), false, "w1#a", t0() + 1_000).await, held, "without resume_own: held");
    assert_eq!(
        claim(keys.clone(), true, "w2#a", t0() + 1_000).await,
        held,
        "another owner's resume_own changes nothing"
    );

    // e1 asked again: handed back with its first token, its lease counted from now.
    assert_eq!(claim(vec![keys[0].clone()], true, "w1#a", t0() + 2_000).await, vec![ClaimOutcome::Resumed(t0())]);
    let later = claim(keys.clone(), false, "w2#a", t0() + 31_000).await;
    assert_eq!(later[0], ClaimOutcome::HeldUntil(t0() + 32_000), "renewed when handed back");
    assert_eq!(later[1], ClaimOutcome::Acquired(t0() + 31_000), "e2's lease ran out: taken over");
    // The token it was handed settles it.
    let done = vec![OwnedKey { key: keys[0].clone(), token: t0() }];
    assert_eq!(
        job(&db, move |tx| Box::pin(async move { ledger::complete(tx, &done, t0() + 33_000).await })).await,
        vec![true]
    );

    // A key twice in one call: handed back once.
    claim(vec![key("e3", "search")], false, "w1#a", t0()).await;
    let twice = claim(vec![key("e3", "search"); 2], true, "w1#a", t0() + 1_000).await;
    assert_eq!(twice, vec![ClaimOutcome::Resumed(t0()), ClaimOutcome::HeldUntil(t0() + 31_000)]);
}

/// Pairs JetStream gave up (deliveries spent or terminated) become dead letters unless they
/// finished; a live claim is left to its holder, and a stale one's owner can no longer settle it.
#[tokio::test]
async fn a_pair_given_up_without_an_outcome_becomes_a_dead_letter() {
    let (_dir, db) = open().await;
    let policy = LedgerPolicy { lease: Duration::from_secs(30), retention: Duration::from_secs(30 * 86_400) };
    let claimed = vec![key("done", "search"), key("live", "search"), key("stale", "search")];
    job(&db, move |tx| {
        Box::pin(async move {
            ledger::claim(tx, &claimed, false, "w1#a", t0(), policy).await?;
            ledger::complete(tx, &[OwnedKey { key: key("done", "search"), token: t0() }], t0()).await
        })
    })
    .await;
    job(&db, move |tx| {
        Box::pin(async move {
            ledger::renew(tx, &[OwnedKey { key: key("live", "search"), token: t0() }], t0() + 50_000).await
        })
    })
    .await;
    let given = |event: &str| GivenUp {
        key: key(event, "search"),
        attempts: 5,
        error: format!("{event} given up"),
        replay: 0,
        given_up_at: t0() + 59_000,
    };
    let pairs = vec![given("done"), given("live"), given("stale"), given("unclaimed")];
    let at = t0() + 60_000;
    let outcomes = job(&db, move |tx| Box::pin(async move { ledger::given_up(tx, &pairs, at, policy).await })).await;
    assert_eq!(
        outcomes,
        vec![
            GivenUpOutcome::Finished,
            GivenUpOutcome::HeldUntil(t0() + 80_000),
            GivenUpOutcome::DeadLettered,
            GivenUpOutcome::DeadLettered,
        ]
    );
    let rows = job(&db, |tx| {
        Box::pin(async move {
            sqlx::query_as::<_, (String, String, i64, String, Option<String>)>(
                "SELECT event_id, status, attempts, COALESCE(last_error, ''), owner FROM processed_events ORDER BY event_id",
            )
            .fetch_all(tx.conn())
            .await
        })
    })
    .await;
    let row = |e: &str| rows.iter().find(|r| r.0 == e).cloned().unwrap();
    assert_eq!(row("stale"), ("stale".into(), "dead_lettered".into(), 5, "stale given up".into(), None));
    assert_eq!(row("unclaimed"), ("unclaimed".into(), "dead_lettered".into(), 5, "unclaimed given up".into(), None));
    assert_eq!(row("done").1, "done");
    assert_eq!(row("live").1, "in_progress");
    // The stale claim's owner, back late, cannot complete what is now a dead letter; asked
    // again, the pair has its outcome.
    let late = vec![OwnedKey { key: key("stale", "search"), token: t0() }];
    assert_eq!(job(&db, move |tx| Box::pin(async move { ledger::complete(tx, &late, at).await })).await, vec![false]);
    let again = vec![given("stale")];
    let outcomes = job(&db, move |tx| Box::pin(async move { ledger::given_up(tx, &again, at, policy).await })).await;
    assert_eq!(outcomes, vec![GivenUpOutcome::Finished]);

    // An operator replayed "replayed" once: the event's own copy, given up late, is superseded
    // (the replay decides), the replay's copy is not. A copy given up longer ago than the
    // retention cannot be judged (its done row may be gone): left alone.
    job(&db, |tx| {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO dead_letter_actions (at, action, event_id, handler, operator, attempts) \
                 VALUES (1, 'replay', 'replayed', 'search', 'op', 5)",
            )
            .execute(tx.conn())
            .await
        })
    })
    .await;
    let old_copy = given("replayed");
    let replay_copy = GivenUp { replay: 1, ..given("replayed") };
    let too_old = GivenUp { given_up_at: at - 31 * 86_400_000, ..given("old") };
    let pairs = vec![old_copy, too_old, replay_copy];
    let outcomes = job(&db, move |tx| Box::pin(async move { ledger::given_up(tx, &pairs, at, policy).await })).await;
    assert_eq!(outcomes, vec![GivenUpOutcome::Finished, GivenUpOutcome::Finished, GivenUpOutcome::DeadLettered]);
}

#[tokio::test]
async fn purge_removes_only_rows_older_than_the_retention() {
    let (_dir, db) = open().await;
    let day = 86_400_000i64;
    let policy = LedgerPolicy { lease: Duration::from_secs(1800), retention: Duration::from_secs(30 * 86_400) };
    // 50 rows done 40 days ago, 50 done 10 days ago, one abandoned claim 31 days old, one fresh claim.
    for (i, processed_days_ago) in (0..100).map(|i| (i, if i < 50 { 40 } else { 10 })) {
        let started = t0() - processed_days_ago * day;
        let owned = vec![OwnedKey { key: key(&format!("e{i}"), "search"), token: started }];
        let claim_key = vec![owned[0].key.clone()];
        job(&db, move |tx| {
            Box::pin(async move {
                ledger::claim(tx, &claim_key, false, "w#a", started, policy).await?;
                ledger::complete(tx, &owned, started).await
            })
        })
        .await;
    }
    let abandoned = vec![key("old", "search")];
    job(&db, move |tx| {
        Box::pin(async move { ledger::claim(tx, &abandoned, false, "w#a", t0() - 31 * day, policy).await })
    })
    .await;
    let fresh = vec![key("new", "search")];
    job(&db, move |tx| Box::pin(async move { ledger::claim(tx, &fresh, false, "w#a", t0(), policy).await })).await;
    // Dead letters an operator discarded are purged like done rows: two old ones, one recent.
    job(&db, |tx| {
        Box::pin(async move {
            sqlx::query("UPDATE processed_events SET status = 'discarded' WHERE event_id IN ('e0', 'e1', 'e60')")
                .execute(tx.conn())
                .await
        })
    })
    .await;

    let purge_all = |abandoned_claims: bool| {
        let db = &db;
        async move {
            let mut total = 0;
            loop {
                let purged = job(db, move |tx| Box::pin(ledger::purge(tx, t0(), policy, 16, abandoned_claims))).await;
                assert!(purged <= 16, "purges in small batches");
                if purged == 0 {
                    return total;
                }
                total += purged;
            }
        }
    };
    // On db an abandoned claim is a delivery its handler has yet to make: it stays.
    assert_eq!(purge_all(false).await, 50);
    let old: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM processed_events WHERE event_id = 'old'")
        .fetch_one(&db.reads)
        .await
        .unwrap();
    assert_eq!(old, 1, "the abandoned delivery is kept");
    // On nats it is only a claim (the event stays in JetStream): it goes.
    assert_eq!(purge_all(true).await, 1);
    let left: Vec<String> = sqlx::query("SELECT event_id FROM processed_events ORDER BY event_id")
        .fetch_all(&db.reads)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left.len(), 51);
    assert!(left.contains(&"new".to_string()) && !left.contains(&"old".to_string()));
    assert!(left.iter().filter(|e| e.starts_with('e')).all(|e| e[1..].parse::<u32>().unwrap() >= 50));
    assert!(left.contains(&"e60".to_string()), "a dead letter discarded 10 days ago stays");
}

/// A relay's claim whose answer was lost: the rows that call claimed and the relay still holds
/// come back to it (to no other claimer, and only to a call naming that one) claimed anew by the
/// call naming it, oldest first within the answer's rows and bytes, their leases counted anew;
/// rows settled, deferred or reclaimed since stay as they are.
#[tokio::test]
async fn rows_whose_claim_answer_was_lost_are_handed_back_to_their_claimer_only_while_it_holds_them() {
    let (_dir, db) = open().await;
    enqueue(&db, 5).await;
    let policy = QueuePolicy { lease: Duration::from_secs(600), ..QueuePolicy::default() };
    let lost_call = ClaimLimits { call: 7, ..limits() };
    let claimed =
        job(&db, move |tx| Box::pin(async move { queue::claim_due(tx, t0(), policy, &lost_call).await })).await;
    let handed: Vec<RowClaim> = claimed.iter().map(|r| RowClaim { id: r.id, claimed_at: r.claimed_at }).collect();
    let resume = |owner: &'static str, unanswered: Vec<u64>, call: u64, now: i64, (max_rows, max_bytes)| {
        let limits = ClaimLimits { owner: owner.into(), max_rows, max_bytes, call };
        job(&db, move |tx| Box::pin(async move { queue::resume(tx, &limits, &unanswered, now).await }))
    };
    let ids = |rows: &[queue::ClaimedRow]| rows.iter().map(|r| r.id).collect::<Vec<_>>();
    let done = Published { row: handed[0], stream_sequence: 1 };
    job(&db, move |tx| Box::pin(async move { queue::complete(tx, &[done]).await })).await;
    let deferred = handed[1];
    job(&db, move |tx| Box::pin(async move { queue::defer(tx, &[deferred], t0() + 3_600_000).await })).await;

    let all = (10, usize::MAX);
    assert!(resume("other#1", vec![7], 8, t0() + 1_000, all).await.is_empty(), "not another's");
    assert!(resume("test#1", vec![6, 8], 8, t0() + 1_000, all).await.is_empty(), "not another call's");
    assert!(resume("test#1", vec![0], 8, t0() + 1_000, all).await.is_empty(), "not a call without an id's");
    let one_row = claimed[2].payload.len() + queue::CLAIM_ROW_OVERHEAD;
    let first = resume("test#1", vec![7], 8, t0() + 1_000, (10, one_row)).await;
    assert_eq!(first.iter().map(|r| (r.id, r.claimed_at)).collect::<Vec<_>>(), vec![(handed[2].id, t0() + 1_000)]);
    assert_eq!(first[0].payload, claimed[2].payload);
    // The lost answer's token of the row handed back settles nothing; the new one does.
    let stale = Published { row: handed[2], stream_sequence: 2 };
    let late = job(&db, move |tx| Box::pin(async move { queue::complete(tx, &[stale]).await })).await;
    assert_eq!((late.settled, late.lost), (0, vec![handed[2].id]));
    let next = resume("test#1", vec![7], 9, t0() + 2_000, (1, usize::MAX)).await;
    assert_eq!(ids(&next), vec![handed[3].id], "row 2 is call 8's now; one row asked for");
    // Calls 8 and 9 went unanswered too: what they took comes back under call 10.
    let again = resume("test#1", vec![8, 9], 10, t0() + 3_000, all).await;
    assert_eq!(ids(&again), vec![handed[2].id, handed[3].id]);
    let fresh = Published { row: RowClaim { id: again[0].id, claimed_at: again[0].claimed_at }, stream_sequence: 3 };
    let settled = job(&db, move |tx| Box::pin(async move { queue::complete(tx, &[fresh]).await })).await;
    assert_eq!(settled.settled, 1);
    assert_eq!(row_state(&db, handed[1].id).await, ("pending".into(), 0, t0() + 3_600_000), "deferred stays deferred");
    // Past the first claim's lease only row 4 is taken over: row 3's lease counts from its hand-back.
    let reclaimed = claim(&db, t0() + 600_001, policy).await;
    assert_eq!(ids(&reclaimed), vec![handed[4].id]);
    assert_eq!(row_state(&db, handed[3].id).await.1, 0, "no attempt spent");
    assert!(resume("test#1", vec![7], 11, t0() + 600_002, all).await.is_empty(), "reclaimed: no longer call 7's");
    assert_eq!(ids(&resume("test#1", vec![10], 11, t0() + 600_002, all).await), vec![handed[3].id]);
}

/// Claims stay within the claimer's answer size, and a row no answer can hold (a foreign
/// writer's, or one from before the size limit) is dead-lettered with its reason instead of
/// failing every claim forever.
#[tokio::test]
async fn claims_are_bounded_by_bytes_and_oversized_rows_are_dead_lettered() {
    let (_dir, db) = open().await;
    let policy = QueuePolicy::default();
    // 20 rows of 40 KB, one of 300 KB in the middle (the 8th).
    job(&db, move |tx| {
        Box::pin(async move {
            for n in 0..20 {
                let size = if n == 7 { 300_000 } else { 40_000 };
                sqlx::query(
                    "INSERT INTO event_queue (event_type, aggregate_id, payload, status, attempts, available_at, created_at) \
                     VALUES ('Foreign', ?, ?, 'pending', 0, 0, 0)",
                )
                .bind(n.to_string())
                .bind(vec![7u8; size])
                .execute(tx.conn())
                .await?;
            }
            Ok(())
        })
    })
    .await;
    let limits = ClaimLimits { owner: "test#1".into(), max_rows: 100, max_bytes: 200_000, call: 0 };
    let mut batches = Vec::new();
    loop {
        let request = limits.clone();
        let claimed =
            job(&db, move |tx| Box::pin(async move { queue::claim_due(tx, t0(), policy, &request).await })).await;
        if claimed.is_empty() {
            break;
        }
        let bytes: usize = claimed.iter().map(|r| r.payload.len() + queue::CLAIM_ROW_OVERHEAD).sum();
        assert!(bytes <= limits.max_bytes, "a claim of {bytes} bytes exceeds {}", limits.max_bytes);
        batches.push(claimed.iter().map(|r| r.aggregate_id.parse::<u32>().unwrap()).collect::<Vec<_>>());
    }
    let claimed: Vec<u32> = batches.concat();
    let expected: Vec<u32> = (0..20).filter(|n| *n != 7).collect();
    assert_eq!(claimed, expected, "every deliverable row claimed once, in order: {batches:?}");
    assert!(batches.iter().all(|b| b.len() <= 4), "200 KB holds four 40 KB rows: {batches:?}");
    let oversized = sqlx::query("SELECT status, last_error FROM event_queue WHERE aggregate_id = '7'")
        .fetch_one(&db.reads)
        .await
        .unwrap();
    assert_eq!(oversized.get::<String, _>(0), "dead_lettered");
    let reason: String = oversized.get(1);
    assert!(reason.contains("300000 bytes"), "the reason names the size: {reason}");
}

/// On nats the oldest waiting row counts from when it was written, while the relay publishes
/// it and however often the relay deferred it (the broker down): not from when it is next due,
/// which made an hour's outage look younger than a minute.
#[tokio::test]
async fn a_deferred_row_waits_since_it_was_written() {
    let (_dir, db) = open().await;
    enqueue(&db, 1).await;
    let created: i64 = sqlx::query_scalar("SELECT created_at FROM event_queue").fetch_one(&db.reads).await.unwrap();
    let now = created + 3_600_000;
    let age = || {
        let db = db.clone();
        async move {
            let mut conn = db.reads.acquire().await.unwrap();
            queue::stats(&mut conn, now, false).await.unwrap().oldest_due_age_ms
        }
    };
    assert_eq!(age().await, 3_600_000);
    let claimed = claim(&db, now, QueuePolicy::default()).await;
    assert_eq!(age().await, 3_600_000, "being published");
    let row = RowClaim { id: claimed[0].id, claimed_at: claimed[0].claimed_at };
    job(&db, move |tx| Box::pin(async move { queue::defer(tx, &[row], now + 30_000).await })).await;
    assert_eq!(age().await, 3_600_000, "deferred, not due again yet");
}

/// On the db backend outbox rows stay `pending`, so what has waited longest is the oldest row a
/// handler has not been handed yet, not the oldest row kept; on nats it is the oldest row not
/// yet published.
#[tokio::test]
async fn the_oldest_waiting_row_follows_the_handlers_cursors_on_db() {
    use reelay_outbox::deliveries::{self, ClaimError, HandlerClaim, HandlerPolicy};
    let (_dir, db) = open().await;
    enqueue(&db, 1).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    enqueue(&db, 1).await;
    let created: Vec<i64> =
        sqlx::query_scalar("SELECT created_at FROM event_queue ORDER BY id").fetch_all(&db.reads).await.unwrap();
    assert!(created[0] < created[1], "{created:?}");
    let now = created[1] + 1_000;
    job(&db, move |tx| Box::pin(async move { deliveries::register(tx, &["h".to_owned()], now).await })).await;
    let age = |cursors: bool| {
        let db = db.clone();
        async move {
            let mut conn = db.reads.acquire().await.unwrap();
            queue::stats(&mut conn, now, cursors).await.unwrap().oldest_due_age_ms
        }
    };
    assert_eq!((age(true).await, age(false).await), (now - created[0], now - created[0]));

    // The handler is handed the first row: on db the second is now the oldest waiting.
    let claim = HandlerClaim {
        handler: "h".into(),
        event_types: vec!["MovieDeleted".into()],
        owner: "test#1".into(),
        max_rows: 1,
        max_bytes: 1 << 20,
        call: 0,
        shared: None,
    };
    let handed = job(&db, move |tx| {
        Box::pin(async move {
            deliveries::claim(tx, now, HandlerPolicy::default(), &claim).await.map_err(|error| match error {
                ClaimError::Sql(error) => error,
                other => panic!("{other}"),
            })
        })
    })
    .await;
    assert_eq!(handed.len(), 1);
    assert_eq!(age(true).await, now - created[1], "db: the row not yet handed");
    assert_eq!(age(false).await, now - created[0], "nats reading: the oldest pending row");
}

/// A restart with a shorter lease holds take-overs back for the longer one, also across a
/// second restart within it; once it has passed, or when the lease grows, nothing is held.
#[tokio::test]
async fn a_shorter_lease_holds_take_overs_back_for_the_longer_one() {
    let (_dir, db) = open().await;
    let note = |lease_s: u64, at: i64| {
        let db = db.clone();
        async move {
            job(&db, move |tx| {
                Box::pin(async move {
                    let held = ledger::note_lease(tx, Duration::from_secs(lease_s), at).await?;
                    Ok((held, tx.lease_counted_from()))
                })
            })
            .await
        }
    };
    let (held, counted) = note(30, t0()).await;
    assert!(held.is_none() && counted < t0(), "the first run holds nothing back");
    let (held, counted) = note(3, t0() + 1_000).await;
    assert_eq!((held, counted), (Some(Duration::from_secs(30)), t0() + 28_000));
    // Restarted again within the longer lease: still held back, from this start.
    let (held, counted) = note(3, t0() + 5_000).await;
    assert_eq!((held, counted), (Some(Duration::from_secs(30)), t0() + 32_000));
    // Once the longer lease has passed since the last start that remembered it, it is over.
    let (held, counted) = note(3, t0() + 40_000).await;
    assert_eq!((held, counted), (None, t0() + 32_000));
    let (held, _) = note(60, t0() + 41_000).await;
    assert_eq!(held, None, "a longer lease holds nothing back");
}
