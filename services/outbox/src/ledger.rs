//! The processed-event ledger (`processed_events`): one row per (event, handler).
//!
//! A claim inserts `in_progress` with the claim's millisecond start time, which is the owner's
//! token; completing (`done`) and releasing (delete) are conditioned on it, so a worker whose
//! claim was taken over cannot clobber the newer claim. The owner renews its claim while the
//! handler runs (`renewed_at`); a claim not renewed for the lease may be taken over, so a dead
//! worker's claims come back in seconds while a live one keeps its own. Every function takes a
//! batch and runs inside one writer job; the clock is an argument so tests can inject time.
//!
//! On the db backend the same rows also carry each handler's delivery state (see
//! [`crate::deliveries`]): `retry` rows are free to claim, `dead_lettered` and `discarded` ones
//! count as settled. On the nats backend a handler's last failed delivery becomes a dead letter
//! here ([`dead_letter`]), so operators find dead letters in one place on both backends.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sqlx::{AssertSqlSafe, Row};

use crate::WriteTx;

#[derive(Debug, Clone, Copy)]
pub struct LedgerPolicy {
    /// A claim not renewed for this long may be taken over (its worker is presumed dead).
    pub lease: Duration,
    /// Done rows older than this are purged.
    pub retention: Duration,
}

impl Default for LedgerPolicy {
    fn default() -> Self {
        Self { lease: Duration::from_secs(30), retention: Duration::from_secs(30 * 24 * 3600) }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LedgerKey {
    pub event_id: String,
    pub handler: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Run the handler; settle with this token.
    Acquired(i64),
    /// Already handled: skip.
    Done,
    /// A fresh claim is held elsewhere until this time (ms).
    HeldUntil(i64),
    /// The owner's own live claim, handed back with its token (the answer that made it was
    /// lost, and the owner runs the pair nowhere): run the handler; settle with this token.
    Resumed(i64),
}

const CHUNK: usize = 200;

fn tuples(n: usize, arity: usize) -> String {
    let one = format!("({})", vec!["?"; arity].join(", "));
    vec![one.as_str(); n].join(", ")
}

/// Claims each key for `owner` (`<instance>#<incarnation>`), in order: acquire a free key, take
/// over a claim not renewed for the lease, or report it done / held. A key named more than once
/// is acquired at most once (its later places find it held).
///
/// With `resume_own` the owner says it runs none of `keys` now: a live claim of that same owner
/// on one of them was made by a call whose answer it never heard (its connection cut, the write
/// service killed before answering) or by work of its that is gone, and is handed back with its
/// token and renewed, instead of reported held until its lease ends.
pub async fn claim(
    tx: &mut WriteTx,
    keys: &[LedgerKey],
    resume_own: bool,
    owner: &str,
    now: i64,
    policy: LedgerPolicy,
) -> Result<Vec<ClaimOutcome>, sqlx::Error> {
    let lease = policy.lease.as_millis() as i64;
    let mut outcomes: HashMap<&LedgerKey, ClaimOutcome> = HashMap::with_capacity(keys.len());
    for chunk in keys.chunks(CHUNK) {
        // Fresh keys: one insert for the chunk; RETURNING names the ones that were free.
        let sql = format!(
            "INSERT INTO processed_events (event_id, handler, status, started_at, renewed_at, owner) VALUES {} \
             ON CONFLICT DO NOTHING RETURNING event_id, handler",
            vec!["(?, ?, 'in_progress', ?, ?, ?)"; chunk.len()].join(", ")
        );
        let mut insert = sqlx::query(AssertSqlSafe(sql));
        for key in chunk {
            insert = insert.bind(key.event_id.clone()).bind(key.handler.clone()).bind(now).bind(now).bind(owner);
        }
        let inserted: Vec<(String, String)> =
            insert.fetch_all(tx.conn()).await?.into_iter().map(|r| (r.get(0), r.get(1))).collect();
        for key in chunk {
            if inserted.iter().any(|(e, h)| *e == key.event_id && *h == key.handler) {
                outcomes.insert(key, ClaimOutcome::Acquired(now));
            }
        }
        // The rest exist already: done, held, or stale.
        let taken: Vec<&LedgerKey> = chunk.iter().filter(|k| !outcomes.contains_key(k)).collect();
        if taken.is_empty() {
            continue;
        }
        let mut select = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_id, handler, status, started_at, COALESCE(renewed_at, started_at), owner \
             FROM processed_events WHERE (event_id, handler) IN (VALUES {})",
            tuples(taken.len(), 2)
        )));
        for key in &taken {
            select = select.bind(key.event_id.clone()).bind(key.handler.clone());
        }
        let existing: HashMap<(String, String), Claimed> = select
            .fetch_all(tx.conn())
            .await?
            .into_iter()
            .map(|r| {
                let claimed = Claimed { status: r.get(2), started: r.get(3), renewed: r.get(4), owner: r.get(5) };
                ((r.get(0), r.get(1)), claimed)
            })
            .collect();
        let leases = Leases::now(tx, now, policy);
        for key in taken {
            let state = existing.get(&(key.event_id.clone(), key.handler.clone()));
            let Some(Claimed { status, started, renewed, owner: held_by }) = state else {
                // Released between the insert and the select cannot happen inside one job;
                // treat a vanished row as free on the next claim.
                outcomes.insert(key, ClaimOutcome::HeldUntil(now));
                continue;
            };
            let outcome = match leases.standing(status, *renewed) {
                Standing::Finished => ClaimOutcome::Done,
                Standing::HeldUntil(_) if resume_own && held_by.as_deref() == Some(owner) => {
                    sqlx::query(
                        "UPDATE processed_events SET renewed_at = ? WHERE event_id = ? AND handler = ? AND started_at = ?",
                    )
                    .bind(now)
                    .bind(key.event_id.clone())
                    .bind(key.handler.clone())
                    .bind(*started)
                    .execute(tx.conn())
                    .await?;
                    tracing::warn!(event_id = %key.event_id, handler = %key.handler, owner,
                        "handing a live ledger claim back to its owner, which runs the pair nowhere (the answer that made it was lost, or the work it was for is gone)");
                    ClaimOutcome::Resumed(*started)
                }
                Standing::HeldUntil(until) => ClaimOutcome::HeldUntil(until),
                Standing::Free => {
                    // Free (`retry`) or abandoned: take it; the new token is always newer than
                    // the one it replaces.
                    let token = now.max(started + 1);
                    sqlx::query(
                        "UPDATE processed_events SET status = 'in_progress', started_at = ?, renewed_at = ?, owner = ?, \
                         claim_call = NULL WHERE event_id = ? AND handler = ? AND started_at = ?",
                    )
                    .bind(token)
                    .bind(now)
                    .bind(owner)
                    .bind(key.event_id.clone())
                    .bind(key.handler.clone())
                    .bind(*started)
                    .execute(tx.conn())
                    .await?;
                    if status == "in_progress" {
                        tracing::warn!(event_id = %key.event_id, handler = %key.handler, stale_token = started,
                            "taking over a ledger claim whose owner stopped renewing it");
                    }
                    ClaimOutcome::Acquired(token)
                }
            };
            outcomes.insert(key, outcome);
        }
    }
    // A key asked twice in one call (two deliveries of one event in a batch) is claimed once:
    // the first asks get the claim, the others find it held, as a later call would.
    let mut answered = HashSet::with_capacity(keys.len());
    Ok(keys
        .iter()
        .map(|k| match outcomes[k] {
            ClaimOutcome::Acquired(_) | ClaimOutcome::Resumed(_) if !answered.insert(k) => {
                ClaimOutcome::HeldUntil(now + lease)
            }
            outcome => outcome,
        })
        .collect())
}

/// A pair's ledger row as a claim finds it.
struct Claimed {
    status: String,
    /// The token of its latest claim.
    started: i64,
    renewed: i64,
    owner: Option<String>,
}

/// Where a pair's ledger row stands under the lease rule every claim goes by.
enum Standing {
    /// Done, dead-lettered or discarded.
    Finished,
    /// A live claim holds it until this time (ms).
    HeldUntil(i64),
    /// Released (`retry`), or claimed by an owner that stopped renewing it.
    Free,
}

/// The lease rule at one moment of a write job.
struct Leases {
    lease: i64,
    counted_from: i64,
    stale: i64,
}

impl Leases {
    /// A claim renewed before leases began to count counts as renewed then (see
    /// `Writer::lease_counted_from`): its owner may not have been able to renew it.
    fn now(tx: &WriteTx, now: i64, policy: LedgerPolicy) -> Self {
        let counted_from = tx.lease_counted_from();
        Self {
            lease: policy.lease.as_millis() as i64,
            counted_from,
            stale: crate::stale_before(counted_from, now, policy.lease),
        }
    }

    fn standing(&self, status: &str, renewed: i64) -> Standing {
        match status {
            "done" | "dead_lettered" | "discarded" => Standing::Finished,
            "in_progress" if renewed > self.stale => Standing::HeldUntil(renewed.max(self.counted_from) + self.lease),
            _ => Standing::Free,
        }
    }
}

/// Records the lease this run of the write service gives claims, and keeps the claims made
/// under a longer one safe. Owners renew at a pace set by the lease they last heard (claim and
/// renewal answers carry it), so after a restart with a shorter lease a live owner may not
/// renew before the new lease runs out: leases then count from `now` plus the difference, so
/// nothing is taken over before the longer lease has passed. The longer lease is remembered
/// until then (`lease_until`), so a second restart within it keeps it too. Runs in a write job
/// at start-up; returns the longer lease still in force, if any. The first run of a database
/// (or of a build before this) has no lease on record and holds nothing back.
pub async fn note_lease(tx: &mut WriteTx, lease: Duration, now: i64) -> Result<Option<Duration>, sqlx::Error> {
    let lease_ms = lease.as_millis() as i64;
    let previous = meta(tx, "lease_ms").await?;
    // 0: the lease of a run that was up until now; else when a remembered longer one ends.
    let until = meta(tx, "lease_until").await?.unwrap_or(0);
    let in_force = previous.filter(|p| *p > lease_ms && (until == 0 || until > now));
    let (record, record_until) = match in_force {
        Some(longer) => {
            tracing::warn!(
                from_ms = longer,
                to_ms = lease_ms,
                "the claim lease is shorter than a recent run's: no claim is taken over before the longer lease has passed"
            );
            tx.count_leases_from(now + longer - lease_ms);
            (longer, now + longer)
        }
        None => (lease_ms, 0),
    };
    for (key, value) in [("lease_ms", record), ("lease_until", record_until)] {
        sqlx::query(
            "INSERT INTO outbox_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        )
        .bind(key)
        .bind(value)
        .execute(tx.conn())
        .await?;
    }
    Ok(in_force.map(|p| Duration::from_millis(p as u64)))
}

async fn meta(tx: &mut WriteTx, key: &str) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT value FROM outbox_meta WHERE key = ?").bind(key).fetch_optional(tx.conn()).await
}

/// A key with the token its owner holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedKey {
    pub key: LedgerKey,
    pub token: i64,
}

async fn settle(
    tx: &mut WriteTx,
    keys: &[OwnedKey],
    head: &str,
    bind_first: Option<i64>,
) -> Result<Vec<bool>, sqlx::Error> {
    let mut owned = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(CHUNK) {
        let mut query = sqlx::query(AssertSqlSafe(format!(
            "{head} WHERE (event_id, handler, started_at) IN (VALUES {}) AND status = 'in_progress' RETURNING event_id, handler",
            tuples(chunk.len(), 3)
        )));
        if let Some(value) = bind_first {
            query = query.bind(value);
        }
        for owned_key in chunk {
            query =
                query.bind(owned_key.key.event_id.clone()).bind(owned_key.key.handler.clone()).bind(owned_key.token);
        }
        let changed: Vec<(String, String)> =
            query.fetch_all(tx.conn()).await?.into_iter().map(|r| (r.get(0), r.get(1))).collect();
        owned.extend(chunk.iter().map(|k| changed.iter().any(|(e, h)| *e == k.key.event_id && *h == k.key.handler)));
    }
    Ok(owned)
}

/// Marks claims done. `false` for a key means "claim lost": a newer claim owns it now and
/// nothing changed.
pub async fn complete(tx: &mut WriteTx, keys: &[OwnedKey], now: i64) -> Result<Vec<bool>, sqlx::Error> {
    settle(tx, keys, "UPDATE processed_events SET status = 'done', processed_at = ?, owner = NULL", Some(now)).await
}

/// The owner is still working on these claims: pushes their leases out. `false` means lost.
pub async fn renew(tx: &mut WriteTx, keys: &[OwnedKey], now: i64) -> Result<Vec<bool>, sqlx::Error> {
    settle(tx, keys, "UPDATE processed_events SET renewed_at = ?", Some(now)).await
}

/// Gives claims up so a retry can claim at once. `false` means the claim was lost.
pub async fn release(tx: &mut WriteTx, keys: &[OwnedKey]) -> Result<Vec<bool>, sqlx::Error> {
    settle(tx, keys, "DELETE FROM processed_events", None).await
}

/// An owned claim whose handler failed for the last time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    pub owned: OwnedKey,
    /// Deliveries spent, the last one included.
    pub attempts: u32,
    pub error: String,
}

/// Turns owned claims into dead letters (their attempts and last error kept). `false` for a key
/// means the claim was lost and nothing changed.
pub async fn dead_letter(tx: &mut WriteTx, dead: &[DeadLetter], now: i64) -> Result<Vec<bool>, sqlx::Error> {
    let mut owned = Vec::with_capacity(dead.len());
    for d in dead {
        let error = reelay_domain::clip_error(&d.error);
        let changed = sqlx::query(
            "UPDATE processed_events SET status = 'dead_lettered', attempts = ?, last_error = ?, processed_at = ?,              owner = NULL WHERE event_id = ? AND handler = ? AND started_at = ? AND status = 'in_progress'",
        )
        .bind(i64::from(d.attempts))
        .bind(&error)
        .bind(now)
        .bind(&d.owned.key.event_id)
        .bind(&d.owned.key.handler)
        .bind(d.owned.token)
        .execute(tx.conn())
        .await?
        .rows_affected();
        if changed > 0 {
            tracing::error!(event_id = %d.owned.key.event_id, handler = %d.owned.key.handler, attempts = d.attempts,
                %error, "delivery dead-lettered for this handler");
        }
        owned.push(changed > 0);
    }
    Ok(owned)
}

/// A pair its event source gave up (see [`given_up`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GivenUp {
    pub key: LedgerKey,
    /// Deliveries the source made.
    pub attempts: u32,
    pub error: String,
    /// The copy given up: 0 the event itself, n its n-th replay to this handler.
    pub replay: u32,
    /// When the source gave it up (ms); 0 if unknown.
    pub given_up_at: i64,
}

/// What [`given_up`] found for a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GivenUpOutcome {
    /// It had no outcome and is a dead letter now.
    DeadLettered,
    /// It already had its outcome (done, dead-lettered or discarded).
    Finished,
    /// A live claim holds it until this time (ms): its holder settles it.
    HeldUntil(i64),
}

/// Records pairs whose event source stopped delivering them (JetStream ran out of deliveries
/// or terminated the message): a pair without an outcome (no row, a released one, or a claim
/// whose owner stopped renewing it) becomes a dead letter, so an operator can replay it. A
/// pair with a live claim is left to its holder (the same lease rule as [`claim`]). Nothing
/// changes for a copy an operator's later replay superseded (the replay has its own fate), or
/// one given up longer ago than the ledger keeps outcomes (a done row may have been purged).
pub async fn given_up(
    tx: &mut WriteTx,
    pairs: &[GivenUp],
    now: i64,
    policy: LedgerPolicy,
) -> Result<Vec<GivenUpOutcome>, sqlx::Error> {
    let leases = Leases::now(tx, now, policy);
    let mut outcomes = Vec::with_capacity(pairs.len());
    let retention = policy.retention.as_millis() as i64;
    for pair in pairs {
        if pair.given_up_at > 0 && pair.given_up_at < now - retention {
            tracing::warn!(event_id = %pair.key.event_id, handler = %pair.key.handler, given_up_at = pair.given_up_at,
                "a delivery given up longer ago than the ledger keeps outcomes: cannot tell whether it finished; left as it is");
            outcomes.push(GivenUpOutcome::Finished);
            continue;
        }
        if i64::from(pair.replay) < crate::dead_letters::replays(tx, &pair.key.event_id, &pair.key.handler).await? {
            outcomes.push(GivenUpOutcome::Finished);
            continue;
        }
        let state: Option<(String, i64)> = sqlx::query_as(
            "SELECT status, COALESCE(renewed_at, started_at) FROM processed_events WHERE event_id = ? AND handler = ?",
        )
        .bind(&pair.key.event_id)
        .bind(&pair.key.handler)
        .fetch_optional(tx.conn())
        .await?;
        let outcome = match state.map(|(status, renewed)| leases.standing(&status, renewed)) {
            Some(Standing::Finished) => GivenUpOutcome::Finished,
            Some(Standing::HeldUntil(until)) => GivenUpOutcome::HeldUntil(until),
            Some(Standing::Free) | None => {
                let error = reelay_domain::clip_error(&pair.error);
                sqlx::query(
                    "INSERT INTO processed_events (event_id, handler, status, started_at, processed_at, attempts, last_error) \
                     VALUES (?1, ?2, 'dead_lettered', ?3, ?3, ?4, ?5) \
                     ON CONFLICT (event_id, handler) DO UPDATE SET status = 'dead_lettered', processed_at = ?3, \
                     attempts = ?4, last_error = ?5, owner = NULL",
                )
                .bind(&pair.key.event_id)
                .bind(&pair.key.handler)
                .bind(now)
                .bind(i64::from(pair.attempts))
                .bind(&error)
                .execute(tx.conn())
                .await?;
                tracing::error!(event_id = %pair.key.event_id, handler = %pair.key.handler, attempts = pair.attempts,
                    %error, "delivery given up by its event source without an outcome: dead-lettered for this handler");
                GivenUpOutcome::DeadLettered
            }
        };
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// The ledger rows retention deletes, each kind found through its own index: done and discarded
/// rows processed before `?1`, and claims abandoned (neither settled nor renewed) since then.
/// Each names one kind so that its `DELETE … IN (…)` finds the rows by key; a `UNION` of them
/// made SQLite read the whole ledger, once a minute in the writer.
pub(crate) const PURGE: [&str; 3] = [
    "DELETE FROM processed_events WHERE (event_id, handler) IN ( \
         SELECT event_id, handler FROM processed_events WHERE status = 'done' AND processed_at < ?1 LIMIT ?2)",
    "DELETE FROM processed_events WHERE (event_id, handler) IN ( \
         SELECT event_id, handler FROM processed_events WHERE status = 'discarded' AND processed_at < ?1 LIMIT ?2)",
    "DELETE FROM processed_events WHERE (event_id, handler) IN ( \
         SELECT event_id, handler FROM processed_events \
         WHERE status IN ('in_progress', 'retry') AND status = 'in_progress' AND started_at < ?1 LIMIT ?2)",
];

/// Deletes up to `batch` rows past retention: done and discarded rows processed before
/// `now - retention`, with `abandoned_claims` claims abandoned that long ago, and handlers'
/// builds not heard from since then ([`crate::deliveries::purge_builds`]). Returns how many
/// went; call again until 0.
///
/// Only the nats backend's abandoned claims may go: there the event stays in JetStream and a
/// delivery of it claims afresh. On db an `in_progress` row is the delivery itself (the
/// handler's cursor has passed its event): deleted, the event would never reach that handler,
/// so it stays until the handler comes back and takes it over.
pub async fn purge(
    tx: &mut WriteTx,
    now: i64,
    policy: LedgerPolicy,
    batch: u32,
    abandoned_claims: bool,
) -> Result<u64, sqlx::Error> {
    let cutoff = now - policy.retention.as_millis() as i64;
    let mut deleted = 0;
    let kinds = if abandoned_claims { &PURGE[..] } else { &PURGE[..2] };
    for sql in kinds {
        let left = u64::from(batch) - deleted;
        if left == 0 {
            break;
        }
        deleted += sqlx::query(*sql).bind(cutoff).bind(left as i64).execute(tx.conn()).await?.rows_affected();
    }
    let left = u64::from(batch) - deleted;
    if left > 0 {
        deleted += crate::deliveries::purge_builds(tx, cutoff, left as u32).await?;
    }
    Ok(deleted)
}
