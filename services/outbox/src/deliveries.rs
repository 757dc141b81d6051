//! Per-handler delivery on the db backend: each (event, handler) has its own attempts, retry
//! schedule and fate, so a failing, slow or stopped handler never holds back another.
//!
//! A write adds one outbox row per event, whatever the number of handlers. Each handler has a
//! cursor into `event_queue`; claiming for a handler hands it the rows after its cursor (those of
//! the types it takes) by creating its `processed_events` row in `in_progress`, and claims its
//! due retries and the claims whose owner stopped renewing them. That row is both the ledger
//! claim (its millisecond `started_at` is the owner's token) and the delivery state; settling
//! it (done, retry, dead-lettered) is conditioned on the token, so a stale owner changes nothing.
//!
//! Every function runs inside a writer job and takes the clock as an argument.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reelay_domain::RetryPolicy;
use sqlx::{AssertSqlSafe, Row};

use crate::WriteTx;
use crate::queue::{CLAIM_ROW_OVERHEAD, claim_call, claim_calls};

/// How per-handler deliveries are leased and retried.
#[derive(Debug, Clone, Copy)]
pub struct HandlerPolicy {
    /// A claim not renewed for this long is presumed dead and may be taken over.
    pub lease: Duration,
    /// Failed deliveries of one event to one handler before it is dead-lettered for that handler.
    pub max_attempts: u32,
    pub retry: RetryPolicy,
}

impl Default for HandlerPolicy {
    fn default() -> Self {
        Self { lease: Duration::from_secs(30), max_attempts: 8, retry: RetryPolicy::default() }
    }
}

/// One handler's claim request.
#[derive(Debug, Clone)]
pub struct HandlerClaim {
    pub handler: String,
    /// The event types the handler takes; other rows are passed over.
    pub event_types: Vec<String>,
    /// `<instance>#<incarnation>` of the claimer.
    pub owner: String,
    pub max_rows: u32,
    /// The largest answer the claimer can read.
    pub max_bytes: usize,
    /// The claimer's id of the call claiming (0: none), written on the deliveries it claims so
    /// that, should the answer be lost, the claimer's next call can name it (see [`resume`]).
    pub call: u64,
    /// Set when this claim's deliveries go out in one answer with other handlers' (one call
    /// claiming for several handlers of a process): the answer's bytes are drawn from here,
    /// not from `max_bytes` each.
    pub shared: Option<SharedAnswer>,
}

/// The bytes left in one answer: a claim's own, or one that several handlers' claims fill
/// together, so that the answer stays within what its reader can take. A row that does not fit
/// what is left waits for the handler's next claim (a claimer for several handlers varies which
/// goes first).
#[derive(Debug, Clone)]
pub struct SharedAnswer(Arc<AtomicUsize>);

impl SharedAnswer {
    pub fn new(bytes: usize) -> Self {
        Self(Arc::new(AtomicUsize::new(bytes)))
    }

    /// Takes `cost` bytes if that many are left.
    fn take(&self, cost: usize) -> bool {
        self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(cost)).is_ok()
    }
}

/// An event handed to a handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedDelivery {
    pub row_id: i64,
    /// The ledger key: the event id, or `row:<id>` for a foreign writer's row without one.
    pub key: String,
    pub event_type: String,
    pub aggregate_id: String,
    pub payload: Vec<u8>,
    /// 1 for the first delivery to this handler.
    pub attempt: u32,
    /// The owner's token: settle with it.
    pub token: i64,
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryOutcome {
    Done,
    /// Spends an attempt: retried after the backoff, or dead-lettered when none are left (or at
    /// once when `terminal`).
    Failed {
        error: String,
        terminal: bool,
    },
    /// Handed back without spending an attempt, due again at `until_ms`.
    Deferred {
        until_ms: i64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    pub key: String,
    pub token: i64,
    pub outcome: DeliveryOutcome,
}

/// What a settle did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    pub settled: usize,
    /// Keys no longer held under the given token; nothing changed for them.
    pub lost: Vec<String>,
    pub dead_lettered: Vec<String>,
}

/// Why a claim was refused.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(
        "handler {0:?} is not registered with the write service; run the write service with a build (and \
         --handler list) that has it, so no event written meanwhile is missed"
    )]
    UnknownHandler(String),
    /// Another build of the handler (other event types) was first heard from later and is
    /// still heard from: this claimer is handed nothing meanwhile (see [`note_builds`]).
    #[error("{0}")]
    StandingBy(String),
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// The key of a row in `processed_events`.
pub fn delivery_key(row_id: i64, event_id: Option<&str>) -> String {
    event_id.map_or_else(|| format!("row:{row_id}"), str::to_owned)
}

/// Makes sure each handler has a cursor. The first cursors ever created start at the delivery
/// floor (the oldest row not yet settled when the schema was upgraded, or the start of a fresh
/// database); a handler added later starts after the newest row, with the events written from
/// now on (the write service registers its handlers before it takes writes, so none is missed).
/// Returns the handlers that were new.
pub async fn register(tx: &mut WriteTx, handlers: &[String], now: i64) -> Result<Vec<String>, sqlx::Error> {
    let existing: Vec<String> = sqlx::query_scalar("SELECT handler FROM handler_cursors").fetch_all(tx.conn()).await?;
    let start: i64 = if existing.is_empty() {
        sqlx::query_scalar("SELECT value FROM outbox_meta WHERE key = 'delivery_floor'").fetch_one(tx.conn()).await?
    } else {
        sqlx::query_scalar("SELECT COALESCE(MAX(id), 0) FROM event_queue").fetch_one(tx.conn()).await?
    };
    let mut added = Vec::new();
    for handler in handlers.iter().filter(|h| !existing.contains(h)) {
        sqlx::query("INSERT INTO handler_cursors (handler, position, created_at, updated_at) VALUES (?, ?, ?, ?)")
            .bind(handler)
            .bind(start)
            .bind(now)
            .bind(now)
            .execute(tx.conn())
            .await?;
        added.push(handler.clone());
    }
    let listed = serde_json::to_string(handlers).expect("strings serialize");
    sqlx::query("UPDATE handler_cursors SET delivered = handler IN (SELECT value FROM json_each(?))")
        .bind(listed)
        .execute(tx.conn())
        .await?;
    Ok(added)
}

/// Why a handler could not be retired.
#[derive(Debug, thiserror::Error)]
pub enum RetireError {
    #[error(
        "handler {0:?} is delivered to by the write service (it is in its build, or its --handler list); restart \
         the write service without it first"
    )]
    Delivered(String),
    #[error("no handler named {0:?} has a cursor here")]
    Unknown(String),
    /// A process still runs it: retiring it would discard what it holds.
    #[error("{0}")]
    Live(String),
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Refuses to retire `handler` when it has no cursor, when the write service delivers to it,
/// or when a process still runs it (a build of it live, or a claim of it live, by the rules the
/// claims go by: heard from within [`BUILD_LIVE_LEASES`] leases, renewed within the lease, and
/// either live when the writer started, `counted_from`, until it could have heard again): what
/// it holds would be discarded under it, and on nats its next claims of a discarded event would
/// be answered done.
pub async fn check_retirable(
    conn: &mut sqlx::SqliteConnection,
    handler: &str,
    now: i64,
    counted_from: i64,
    lease: Duration,
) -> Result<(), RetireError> {
    let row: Option<(bool, Option<i64>, Option<i64>)> = sqlx::query_as(
        "SELECT c.delivered, (SELECT MAX(last_seen) FROM handler_builds b WHERE b.handler = c.handler), \
             (SELECT MAX(renewed_at) FROM processed_events p WHERE p.handler = c.handler \
                 AND p.status IN ('in_progress', 'retry') AND p.status = 'in_progress') \
         FROM handler_cursors c WHERE c.handler = ?",
    )
    .bind(handler)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((delivered, heard, renewed)) = row else { return Err(RetireError::Unknown(handler.to_owned())) };
    if delivered {
        return Err(RetireError::Delivered(handler.to_owned()));
    }
    let heard = heard.filter(|&at| at >= builds_live_since(now, counted_from, lease));
    let renewed = renewed.filter(|&at| at > crate::stale_before(counted_from, now, lease));
    if let Some(at) = heard.into_iter().chain(renewed).max() {
        let started = if at < counted_from {
            format!(
                ", before this write service started {} ms ago: it may not have been heard since",
                now - counted_from
            )
        } else {
            String::new()
        };
        return Err(RetireError::Live(format!(
            "handler {handler:?} is still run by a process (heard from {} ms ago{started}); stop every process \
             running it, then retire it once it has not been heard from for {} ms",
            now - at,
            build_live_span(lease)
        )));
    }
    Ok(())
}

/// What retiring a handler did besides dropping its cursor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retired {
    /// Its dead letters, now discarded and recorded in `dead_letter_actions`.
    pub dead_letters: u64,
    /// Its claimed and retrying deliveries, now discarded.
    pub open: u64,
}

/// Forgets a handler the write service no longer delivers to: its cursor (on db it holds
/// outbox retention back for ever), its builds, and its open and dead-lettered deliveries,
/// which are marked discarded (each dead letter recorded as discarded by `operator`). All in
/// the caller's one job, after the check: a refused retire changes nothing. Refused for a
/// handler the write service delivers to: it would then be handed nothing, and events written
/// meanwhile would reach it only from a new cursor at its next start.
pub async fn retire(
    tx: &mut WriteTx,
    handler: &str,
    operator: &str,
    now: i64,
    lease: Duration,
) -> Result<Retired, RetireError> {
    let counted_from = tx.lease_counted_from();
    check_retirable(tx.conn(), handler, now, counted_from, lease).await?;
    // Each dead letter recorded as an operator's discard is, then every open delivery and dead
    // letter discarded (a dead letter keeps its last error).
    let statements = [
        "INSERT INTO dead_letter_actions (at, action, event_id, handler, operator, attempts, last_error) \
         SELECT ?, 'discard', event_id, handler, ?, attempts, last_error FROM processed_events \
         WHERE handler = ? AND status = 'dead_lettered' ORDER BY event_id",
        "UPDATE processed_events SET status = 'discarded', owner = NULL, processed_at = ?, \
         last_error = CASE WHEN status = 'dead_lettered' THEN last_error ELSE 'handler retired by ' || ? END \
         WHERE handler = ? AND status IN ('in_progress', 'retry', 'dead_lettered')",
    ];
    let mut changed = [0; 2];
    for (rows, statement) in changed.iter_mut().zip(statements) {
        let done = sqlx::query(statement).bind(now).bind(operator).bind(handler).execute(tx.conn()).await?;
        *rows = done.rows_affected();
    }
    let [dead_letters, discarded] = changed;
    sqlx::query("DELETE FROM handler_cursors WHERE handler = ?").bind(handler).execute(tx.conn()).await?;
    sqlx::query("DELETE FROM handler_builds WHERE handler = ?").bind(handler).execute(tx.conn()).await?;
    let open = discarded - dead_letters;
    tracing::warn!(
        %handler,
        operator,
        dead_letters_discarded = dead_letters,
        open_discarded = open,
        "handler retired: its cursor, open deliveries and dead letters are gone"
    );
    Ok(Retired { dead_letters, open })
}

/// An outbox row a handler is to be handed.
struct Candidate {
    id: i64,
    event_id: Option<String>,
    length: i64,
}

/// Claims deliveries for one handler within its limits: first its due retries and the claims
/// whose owner stopped renewing them, then rows after its cursor.
pub async fn claim(
    tx: &mut WriteTx,
    now: i64,
    policy: HandlerPolicy,
    request: &HandlerClaim,
) -> Result<Vec<ClaimedDelivery>, ClaimError> {
    let mut answers = claim_many(tx, now, policy, std::slice::from_ref(request)).await?;
    answers.pop().expect("one answer per request")
}

/// What [`claim`] does for each request, with the statements shared between handlers: one
/// read of the cursors, one of the open claims, one scan of new rows for the handlers that
/// stand at the same position, one insert of every handler's claims, one cursor update and one
/// read of the payloads. With many handlers per event this keeps the single writer's work per
/// event nearly flat. Requests for the same handler (replicas) are served one after the other,
/// the later one from where the earlier left the cursor. Answers are in request order.
pub async fn claim_many(
    tx: &mut WriteTx,
    now: i64,
    policy: HandlerPolicy,
    requests: &[HandlerClaim],
) -> Result<Vec<Result<Vec<ClaimedDelivery>, ClaimError>>, sqlx::Error> {
    // Rounds of distinct handlers: a handler's second request goes to a later round.
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (index, request) in requests.iter().enumerate() {
        match rounds.iter_mut().find(|round| round.iter().all(|&i| requests[i].handler != request.handler)) {
            Some(round) => round.push(index),
            None => rounds.push(vec![index]),
        }
    }
    // Every build is noted before any claim: an older build's claim must not pass over rows
    // in the same job as the newer build's first. A standing-by one is answered so, and claims
    // nothing.
    let builds: Vec<(&str, String)> =
        requests.iter().map(|r| (r.handler.as_str(), build_key(&r.event_types))).collect();
    let mut answers: Vec<Option<Result<Vec<ClaimedDelivery>, ClaimError>>> =
        note_builds(tx, now, policy.lease, &builds)
            .await?
            .into_iter()
            .map(|standing_by| standing_by.map(|why| Err(ClaimError::StandingBy(why))))
            .collect();
    for round in rounds {
        let round: Vec<usize> = round.into_iter().filter(|&i| answers[i].is_none()).collect();
        let claims: Vec<&HandlerClaim> = round.iter().map(|&i| &requests[i]).collect();
        for (index, answer) in round.into_iter().zip(claim_round(tx, now, policy, &claims).await?) {
            answers[index] = Some(answer);
        }
    }
    Ok(answers.into_iter().map(|answer| answer.expect("every request is in a round")).collect())
}

/// One handler's part of a claim while it is being decided.
struct Claiming<'r> {
    request: &'r HandlerClaim,
    position: i64,
    moved_to: i64,
    budget: Budget,
    /// (row id, key, attempt, token) of what it is handed.
    taken: Vec<(i64, String, u32, i64)>,
    /// New rows it is to be handed (their ledger rows not yet created).
    handed: Vec<Candidate>,
}

/// Claims for handlers that are all distinct.
async fn claim_round(
    tx: &mut WriteTx,
    now: i64,
    policy: HandlerPolicy,
    requests: &[&HandlerClaim],
) -> Result<Vec<Result<Vec<ClaimedDelivery>, ClaimError>>, sqlx::Error> {
    let sql = format!(
        "SELECT handler, position FROM handler_cursors WHERE handler IN ({})",
        vec!["?"; requests.len()].join(", ")
    );
    let mut query = sqlx::query_as(AssertSqlSafe(sql));
    for request in requests {
        query = query.bind(&request.handler);
    }
    let positions: HashMap<String, i64> = query.fetch_all(tx.conn()).await?.into_iter().collect();
    let mut claiming: Vec<Claiming> = requests
        .iter()
        .filter_map(|&request| {
            let position = *positions.get(&request.handler)?;
            Some(Claiming {
                request,
                position,
                moved_to: position,
                budget: Budget::of(request),
                taken: Vec::new(),
                handed: Vec::new(),
            })
        })
        .collect();
    if !claiming.is_empty() {
        claim_open(tx, now, policy, &mut claiming).await?;
        claim_new(tx, now, &mut claiming).await?;
    }
    let row_ids: Vec<i64> = claiming.iter().flat_map(|c| c.taken.iter().map(|t| t.0)).collect();
    let loaded = load(tx, row_ids).await?;
    let mut answers = Vec::with_capacity(requests.len());
    for request in requests {
        let Some(c) = claiming.iter_mut().find(|c| c.request.handler == request.handler) else {
            answers.push(Err(ClaimError::UnknownHandler(request.handler.clone())));
            continue;
        };
        let mut claimed: Vec<ClaimedDelivery> = std::mem::take(&mut c.taken)
            .into_iter()
            .filter_map(|(row_id, key, attempt, token)| {
                let (event_type, aggregate_id, payload) = loaded.get(&row_id)?.clone();
                Some(ClaimedDelivery { row_id, key, event_type, aggregate_id, payload, attempt, token })
            })
            .collect();
        claimed.sort_by_key(|d| d.row_id);
        answers.push(Ok(claimed));
    }
    Ok(answers)
}

/// The key a build of a handler is known by: the event types its claims name.
fn build_key(event_types: &[String]) -> String {
    let mut types: Vec<&str> = event_types.iter().map(String::as_str).collect();
    types.sort_unstable();
    types.dedup();
    types.join(",")
}

/// How many leases a build of a handler stays live after it was last heard from. A live
/// claimer is heard at least every quarter lease, idle or not (its claims, its ledger claims,
/// or the note an idle one sends): a build is taken for gone only well after that, at the cost
/// of an older build rolled back to standing by that long after the newer one stops.
pub const BUILD_LIVE_LEASES: u32 = 4;

/// Notes which builds of the handlers are heard from (see migration 0129) and says which stand
/// by. A build is live while it was heard from within [`BUILD_LIVE_LEASES`] leases; the newest
/// is the one first heard from last (never reset: one back after a partition longer than that
/// is still the newer, and one whose processes are idle stays live through the notes they
/// send). Of a handler's live builds only the newest is handed anything: during a rolling update
/// the older build would pass over the rows of a type only the newer one takes, and take its
/// retries of them and skip them (on nats, ack the messages of that type its consumer now brings
/// it). Returns, for each of `builds` ((handler, [`build_key`])) in order, why it stands by
/// when it does. Unregistered handlers are passed.
async fn note_builds(
    tx: &mut WriteTx,
    now: i64,
    lease: Duration,
    builds: &[(&str, String)],
) -> Result<Vec<Option<String>>, sqlx::Error> {
    if builds.is_empty() {
        return Ok(Vec::new());
    }
    let (lease_ms, span) = (lease.as_millis() as i64, build_live_span(lease));
    let live_since = builds_live_since(now, tx.lease_counted_from(), lease);
    let sql = format!(
        "SELECT c.handler, b.event_types, COALESCE(b.first_seen, 0), COALESCE(b.last_seen, 0) FROM handler_cursors c \
             LEFT JOIN handler_builds b ON b.handler = c.handler WHERE c.handler IN ({})",
        vec!["?"; builds.len()].join(", ")
    );
    let mut query = sqlx::query_as(AssertSqlSafe(sql));
    for (handler, _) in builds {
        query = query.bind(*handler);
    }
    let rows: Vec<(String, Option<String>, i64, i64)> = query.fetch_all(tx.conn()).await?;
    let registered: HashSet<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    // (handler, build key, first seen, last seen)
    let mut known: Vec<(String, String, i64, i64)> = rows
        .iter()
        .filter_map(|(handler, key, first, last)| Some((handler.clone(), key.clone()?, *first, *last)))
        .collect();
    // First every build heard from is noted, so that of two builds claiming in one job the
    // newer wins whichever asked first.
    for (handler, key) in builds.iter().filter(|(handler, _)| registered.contains(handler)) {
        let (first_seen, write, back) = match known.iter_mut().find(|(h, k, ..)| h == handler && k == key) {
            // Its last word is written at most every quarter lease.
            Some((.., first_seen, last_seen)) => {
                let noted = (*first_seen, now - *last_seen >= lease_ms / 4, *last_seen < live_since);
                *last_seen = now;
                noted
            }
            None => {
                known.push((handler.to_string(), key.clone(), now, now));
                (now, true, false)
            }
        };
        if !write {
            continue;
        }
        sqlx::query(
            "INSERT INTO handler_builds (handler, event_types, first_seen, last_seen) VALUES (?, ?, ?, ?) \
             ON CONFLICT (handler, event_types) DO UPDATE SET last_seen = excluded.last_seen",
        )
        .bind(handler)
        .bind(key)
        .bind(first_seen)
        .bind(now)
        .execute(tx.conn())
        .await?;
        let others: Vec<&str> = known
            .iter()
            .filter(|(h, k, _, last_seen)| h == handler && k != key && *last_seen >= live_since)
            .map(|(_, k, ..)| k.as_str())
            .collect();
        if (first_seen == now || back) && !others.is_empty() {
            tracing::warn!(%handler, this_build = %key, other_builds = ?others,
                "a build of this handler is heard from beside others; only the one first heard from last is handed anything");
        }
    }
    let standing_by = |(handler, key): &(&str, String)| {
        if !registered.contains(handler) {
            return None;
        }
        let newest = newest_build(known.iter().filter(|(h, ..)| h == handler), live_since)
            .expect("the claimer's own build is live");
        (newest.1 != *key).then(|| {
            format!(
                "handler {handler:?}: another build of it, taking [{}], was first heard from after this one \
                 (taking [{key}]) and was last heard from {} ms ago; this one is handed nothing until that build \
                 has not been heard from for {span} ms ({BUILD_LIVE_LEASES} claim leases), so no event of a type \
                 only it takes is passed over",
                newest.1,
                now - newest.3,
            )
        })
    };
    Ok(builds.iter().map(standing_by).collect())
}

/// Since when a build heard from counts as live at `now`: within [`BUILD_LIVE_LEASES`] leases;
/// until that long has passed since the writer started (`counted_from`: it could hear no one
/// before), the builds live when it started stay live.
fn builds_live_since(now: i64, counted_from: i64, lease: Duration) -> i64 {
    let span = build_live_span(lease);
    if now - counted_from >= span { now - span } else { counted_from - span }
}

/// How long (ms) a build stays live after it was last heard from.
fn build_live_span(lease: Duration) -> i64 {
    i64::from(BUILD_LIVE_LEASES) * lease.as_millis() as i64
}

/// Of one handler's builds ((handler, key, first seen, last seen)), the one handed work: the
/// newest live one (ties, two builds first heard from in the same millisecond: the larger key,
/// so that every claimer agrees).
fn newest_build<'a>(
    builds: impl Iterator<Item = &'a (String, String, i64, i64)>,
    live_since: i64,
) -> Option<&'a (String, String, i64, i64)> {
    builds.filter(|(.., last_seen)| *last_seen >= live_since).max_by(|a, b| (a.2, &a.1).cmp(&(b.2, &b.1)))
}

/// A build of a handler as the write service last heard of it (see [`note_builds`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Build {
    pub handler: String,
    /// The event types it takes.
    pub event_types: Vec<String>,
    pub first_seen: i64,
    pub last_seen: i64,
    /// Heard from recently enough to count as run somewhere.
    pub live: bool,
    /// The live build handed work; the other live ones stand by.
    pub handed: bool,
}

/// Every build of every handler, by handler and then newest first, with which is live and
/// which is handed work at `now` (`counted_from`: the writer's, see
/// [`crate::Writer::lease_counted_from`]).
pub async fn builds(
    conn: &mut sqlx::SqliteConnection,
    now: i64,
    counted_from: i64,
    lease: Duration,
) -> Result<Vec<Build>, sqlx::Error> {
    let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT handler, event_types, first_seen, last_seen FROM handler_builds \
         ORDER BY handler, first_seen DESC, event_types DESC",
    )
    .fetch_all(conn)
    .await?;
    let live_since = builds_live_since(now, counted_from, lease);
    let mut builds = Vec::with_capacity(rows.len());
    // Rows come grouped by handler: each handler's newest live build is found once.
    for handler in rows.chunk_by(|a, b| a.0 == b.0) {
        let newest = newest_build(handler.iter(), live_since);
        builds.extend(handler.iter().map(|row| Build {
            handler: row.0.clone(),
            event_types: row.1.split(',').filter(|t| !t.is_empty()).map(str::to_owned).collect(),
            first_seen: row.2,
            last_seen: row.3,
            live: row.3 >= live_since,
            handed: newest == Some(row),
        }));
    }
    Ok(builds)
}

/// Forgets up to `batch` builds not heard from since `cutoff` (the ledger's retention, days at
/// least: long after they stopped counting as live). One that comes back later is noted as new,
/// which it is: the build deployed last.
pub async fn purge_builds(tx: &mut WriteTx, cutoff: i64, batch: u32) -> Result<u64, sqlx::Error> {
    let deleted = sqlx::query(
        "DELETE FROM handler_builds WHERE (handler, event_types) IN \
             (SELECT handler, event_types FROM handler_builds WHERE last_seen < ?1 LIMIT ?2)",
    )
    .bind(cutoff)
    .bind(i64::from(batch))
    .execute(tx.conn())
    .await?;
    Ok(deleted.rows_affected())
}

/// For the ledger's claims (nats backend): notes the builds of the handlers (name, event types)
/// and returns, for each handler whose build stands by, why (see [`note_builds`]).
pub async fn builds_standing_by(
    tx: &mut WriteTx,
    now: i64,
    lease: Duration,
    builds: &[(String, Vec<String>)],
) -> Result<HashMap<String, String>, sqlx::Error> {
    let keyed: Vec<(&str, String)> =
        builds.iter().map(|(handler, types)| (handler.as_str(), build_key(types))).collect();
    let standing_by = note_builds(tx, now, lease, &keyed).await?;
    Ok(keyed.iter().zip(standing_by).filter_map(|((handler, _), why)| Some((handler.to_string(), why?))).collect())
}

struct Budget {
    rows: usize,
    /// The bytes the answer may still carry: the claim's own, or those it shares with other
    /// handlers' claims in one answer.
    bytes: SharedAnswer,
}

impl Budget {
    /// What `request` may be handed.
    fn of(request: &HandlerClaim) -> Self {
        Self {
            rows: request.max_rows as usize,
            bytes: request.shared.clone().unwrap_or_else(|| SharedAnswer::new(request.max_bytes)),
        }
    }

    /// Takes a row of `length` bytes if it fits. (A row too large for any answer never comes
    /// here: it is dead-lettered.)
    fn take(&mut self, length: i64) -> bool {
        let fits = self.rows > 0 && self.bytes.take(length as usize + CLAIM_ROW_OVERHEAD);
        if fits {
            self.rows -= 1;
        }
        fits
    }
}

/// Due retries and expired claims of the handlers, taken over under a new token.
async fn claim_open(
    tx: &mut WriteTx,
    now: i64,
    policy: HandlerPolicy,
    claiming: &mut [Claiming<'_>],
) -> Result<(), sqlx::Error> {
    let stale = crate::stale_before(tx.lease_counted_from(), now, policy.lease);
    let most = claiming.iter().map(|c| c.budget.rows).max().unwrap_or(0);
    let mut query = sqlx::query_as(AssertSqlSafe(claim_open_sql(claiming.len())));
    for c in claiming.iter() {
        query = query.bind(&c.request.handler);
    }
    let open: Vec<(String, String, i64, i64, String, Option<String>)> =
        query.bind(now).bind(stale).bind(most as i64).fetch_all(tx.conn()).await?;
    if open.is_empty() {
        return Ok(());
    }
    let rows = outbox_rows_of(tx, open.iter().map(|o| o.1.as_str())).await?;
    for (handler, key, attempts, started_at, status, owner) in open {
        let c = claiming.iter_mut().find(|c| c.request.handler == handler).expect("asked for by handler");
        // A claim whose owner stopped renewing it spends an attempt, as a JetStream redelivery
        // does: an event that kills (or stalls) every process that runs it is given up after
        // `max_attempts`, instead of taking down each next owner for ever.
        let attempts = if status == "in_progress" { attempts + 1 } else { attempts };
        let given_up = match rows.get(&key) {
            // The outbox row is gone (deleted by hand or by retention): nothing left to deliver.
            None => Some("the event is no longer in the outbox".to_owned()),
            // No answer to this claimer can hold it (a dead letter replayed as it was, or a
            // smaller message limit since): given up again, or it would head every claim of
            // the handler, which would get nothing else for ever.
            Some(&(_, length)) if length as usize + CLAIM_ROW_OVERHEAD > c.request.max_bytes => {
                Some(undeliverable(length, c.request.max_bytes))
            }
            _ if status == "in_progress" && attempts >= i64::from(policy.max_attempts) => {
                Some(stopped_during(attempts))
            }
            _ => None,
        };
        if let Some(reason) = given_up {
            tracing::error!(event_id = %key, %handler, %reason, "delivery dead-lettered");
            sqlx::query(
                "UPDATE processed_events SET status = 'dead_lettered', attempts = ?, last_error = ?, processed_at = ?, \
                 owner = NULL WHERE event_id = ? AND handler = ? AND started_at = ?",
            )
            .bind(attempts)
            .bind(reason)
            .bind(now)
            .bind(&key)
            .bind(&handler)
            .bind(started_at)
            .execute(tx.conn())
            .await?;
            continue;
        }
        let (row_id, length) = rows[&key];
        if !c.budget.take(length) {
            // This handler's answer is full; its other open rows wait for its next claim.
            c.budget.rows = 0;
            continue;
        }
        if status == "in_progress" {
            tracing::warn!(event_id = %key, %handler, stale_owner = owner.unwrap_or_default(),
                "taking over a delivery whose owner stopped renewing its claim");
        }
        let token = now.max(started_at + 1);
        sqlx::query(
            "UPDATE processed_events SET status = 'in_progress', started_at = ?, renewed_at = ?, owner = ?, \
             claim_call = ?, attempts = ? WHERE event_id = ? AND handler = ? AND started_at = ?",
        )
        .bind(token)
        .bind(now)
        .bind(&c.request.owner)
        .bind(claim_call(c.request.call))
        .bind(attempts)
        .bind(&key)
        .bind(&handler)
        .bind(started_at)
        .execute(tx.conn())
        .await?;
        c.taken.push((row_id, key, attempts as u32 + 1, token));
    }
    Ok(())
}

/// The outbox row id and payload length of each delivery key.
async fn outbox_rows_of<'k>(
    tx: &mut WriteTx,
    keys: impl Iterator<Item = &'k str>,
) -> Result<HashMap<String, (i64, i64)>, sqlx::Error> {
    let (mut by_row, mut by_event): (Vec<i64>, Vec<&str>) = (Vec::new(), Vec::new());
    for key in keys {
        match key.strip_prefix("row:").and_then(|id| id.parse().ok()) {
            Some(row_id) => by_row.push(row_id),
            None => by_event.push(key),
        }
    }
    let mut found = HashMap::new();
    for chunk in by_event.chunks(500) {
        let sql = format!(
            "SELECT event_id, id, length(payload) FROM event_queue WHERE event_id IN ({})",
            vec!["?"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for key in chunk {
            query = query.bind(*key);
        }
        for r in query.fetch_all(tx.conn()).await? {
            found.insert(r.get::<String, _>(0), (r.get(1), r.get(2)));
        }
    }
    for chunk in by_row.chunks(500) {
        let sql =
            format!("SELECT id, length(payload) FROM event_queue WHERE id IN ({})", vec!["?"; chunk.len()].join(", "));
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for row_id in chunk {
            query = query.bind(row_id);
        }
        for r in query.fetch_all(tx.conn()).await? {
            let row_id: i64 = r.get(0);
            found.insert(format!("row:{row_id}"), (row_id, r.get(1)));
        }
    }
    Ok(found)
}

/// Why a delivery whose owner stopped during its last attempt is given up.
fn stopped_during(attempts: i64) -> String {
    format!(
        "its worker stopped while running it (killed, or its claim not renewed) in {attempts} attempt(s), \
         EVENT_QUEUE_MAX_ATTEMPTS: given up so it takes down no more"
    )
}

/// Why an event of `length` bytes is dead-lettered for a claimer whose answers hold `max_bytes`.
fn undeliverable(length: i64, max_bytes: usize) -> String {
    format!(
        "undeliverable: the event is {length} bytes and a claim answer holds at most {} bytes of event \
         (REELAY_GRPC_MAX_MESSAGE_BYTES)",
        max_bytes.saturating_sub(CLAIM_ROW_OVERHEAD)
    )
}

/// Rows after each handler's cursor: each of its types is handed over (its `processed_events`
/// row created), others are passed; the cursor then moves past everything decided. Handlers
/// whose positions are close share one read of the outbox, from the lowest of them.
async fn claim_new(tx: &mut WriteTx, now: i64, claiming: &mut [Claiming<'_>]) -> Result<(), sqlx::Error> {
    let mut starts: Vec<i64> = claiming.iter().filter(|c| c.budget.rows > 0).map(|c| c.position).collect();
    starts.sort_unstable();
    starts.dedup();
    let mut oversized: Vec<(usize, Candidate)> = Vec::new();
    for (start, last_start) in shared_reads(&starts) {
        let members: Vec<usize> = (0..claiming.len())
            .filter(|&i| (start..=last_start).contains(&claiming[i].position) && claiming[i].budget.rows > 0)
            .collect();
        let mut types: Vec<&str> =
            members.iter().flat_map(|&i| claiming[i].request.event_types.iter().map(String::as_str)).collect();
        types.sort_unstable();
        types.dedup();
        // Enough rows for the largest budget after the highest position: at most
        // `last_start - start` rows lie between the lowest position and the highest.
        let limit = members.iter().map(|&i| claiming[i].budget.rows).max().unwrap_or(1) + (last_start - start) as usize;
        // The rows after the lowest position of a type one of them takes (rows settled before
        // per-handler delivery, on upgraded databases, are passed), as many as `limit`, and the
        // newest row's id (length -1): SQLite steps over the other types itself, so a handler
        // far behind on rows it does not take catches up in this one read, and one that finds
        // nothing more moves past everything there is.
        let sql = format!(
            "SELECT id, event_id, event_type, length(payload) FROM (SELECT id, event_id, event_type, payload \
                 FROM event_queue WHERE id > ? AND status NOT IN ('done', 'dead_lettered') AND event_type IN ({}) \
                 ORDER BY id LIMIT ?) \
             UNION ALL SELECT COALESCE(MAX(id), 0), NULL, '', -1 FROM event_queue",
            vec!["?"; types.len()].join(", ")
        );
        let mut query = sqlx::query_as(AssertSqlSafe(sql)).bind(start);
        for event_type in &types {
            query = query.bind(*event_type);
        }
        let mut candidates: Vec<(i64, Option<String>, String, i64)> =
            query.bind(limit as i64).fetch_all(tx.conn()).await?;
        let newest = candidates.iter().find(|c| c.3 < 0).map_or(start, |c| c.0);
        candidates.retain(|c| c.3 >= 0);
        // Everything up to here has been seen for every member.
        let seen_to = if candidates.len() == limit { candidates.last().map_or(start, |c| c.0) } else { newest };
        for i in members {
            let c = &mut claiming[i];
            c.moved_to = seen_to.max(c.position);
            for (id, event_id, event_type, length) in &candidates {
                if *id <= c.position || !c.request.event_types.contains(event_type) {
                    continue;
                }
                let candidate = Candidate { id: *id, event_id: event_id.clone(), length: *length };
                if *length as usize + CLAIM_ROW_OVERHEAD > c.request.max_bytes {
                    oversized.push((i, candidate));
                } else if c.budget.take(*length) {
                    c.handed.push(candidate);
                } else {
                    // Its answer is full: this row and what follows wait for its next claim.
                    c.moved_to = id - 1;
                    break;
                }
            }
        }
    }
    for (i, candidate) in oversized {
        let request = claiming[i].request;
        let reason = undeliverable(candidate.length, request.max_bytes);
        let key = delivery_key(candidate.id, candidate.event_id.as_deref());
        tracing::error!(event_id = %key, handler = %request.handler, %reason, "delivery dead-lettered");
        sqlx::query(
            "INSERT INTO processed_events (event_id, handler, status, started_at, renewed_at, processed_at, attempts, \
             last_error) VALUES (?, ?, 'dead_lettered', ?, ?, ?, 0, ?) ON CONFLICT DO NOTHING",
        )
        .bind(key)
        .bind(&request.handler)
        .bind(now)
        .bind(now)
        .bind(now)
        .bind(reason)
        .execute(tx.conn())
        .await?;
    }
    // Every handler's new claims in one insert (a few, for large claims).
    let handed: Vec<(usize, Candidate)> = claiming
        .iter_mut()
        .enumerate()
        .flat_map(|(i, c)| std::mem::take(&mut c.handed).into_iter().map(move |candidate| (i, candidate)))
        .collect();
    for chunk in handed.chunks(200) {
        let sql = format!(
            "INSERT INTO processed_events (event_id, handler, status, started_at, renewed_at, owner, claim_call, \
             attempts) VALUES {} ON CONFLICT DO NOTHING",
            vec!["(?, ?, 'in_progress', ?, ?, ?, ?, 0)"; chunk.len()].join(", ")
        );
        let mut insert = sqlx::query(AssertSqlSafe(sql));
        for (i, candidate) in chunk {
            let request = claiming[*i].request;
            insert = insert
                .bind(delivery_key(candidate.id, candidate.event_id.as_deref()))
                .bind(&request.handler)
                .bind(now)
                .bind(now)
                .bind(&request.owner)
                .bind(claim_call(request.call));
        }
        // Every row inserted is the common case, and needs no rows back; otherwise a key that
        // already had a row was handled before (or is claimed elsewhere, and comes back through
        // its lease) and is passed: the rows this insert created are read back.
        let inserted = insert.execute(tx.conn()).await?.rows_affected() as usize;
        let created = if inserted == chunk.len() {
            None
        } else {
            let keys: Vec<(String, &str, &str)> = chunk
                .iter()
                .map(|(i, candidate)| {
                    let request = claiming[*i].request;
                    (
                        delivery_key(candidate.id, candidate.event_id.as_deref()),
                        request.handler.as_str(),
                        request.owner.as_str(),
                    )
                })
                .collect();
            Some(created_now(tx, &keys, now).await?)
        };
        for (i, candidate) in chunk {
            let key = delivery_key(candidate.id, candidate.event_id.as_deref());
            let c = &mut claiming[*i];
            // A row this job took over (an expired claim, on an upgraded database, of an event
            // past the new cursor) looks created now too: it is handed once, as the take-over.
            let fresh = created.as_ref().is_none_or(|created| {
                created.contains(&(key.clone(), c.request.handler.clone()))
                    && !c.taken.iter().any(|(_, taken, _, _)| *taken == key)
            });
            if fresh {
                c.taken.push((candidate.id, key, 1, now));
            }
        }
    }
    let moved: Vec<&Claiming> = claiming.iter().filter(|c| c.moved_to != c.position).collect();
    if !moved.is_empty() {
        let sql = format!(
            "UPDATE handler_cursors SET position = v.column2, updated_at = ? FROM (VALUES {}) AS v \
             WHERE handler_cursors.handler = v.column1",
            vec!["(?, ?)"; moved.len()].join(", ")
        );
        let mut update = sqlx::query(AssertSqlSafe(sql)).bind(now);
        for c in moved {
            update = update.bind(&c.request.handler).bind(c.moved_to);
        }
        update.execute(tx.conn()).await?;
    }
    Ok(())
}

/// Which of the (key, handler, owner) claims were created by this job's insert at `now`: first
/// deliveries held by their owner under the job's token (a row that existed before has another
/// token, owner or attempt count).
async fn created_now(
    tx: &mut WriteTx,
    claims: &[(String, &str, &str)],
    now: i64,
) -> Result<HashSet<(String, String)>, sqlx::Error> {
    let sql = format!(
        "SELECT p.event_id, p.handler FROM (VALUES {}) AS v JOIN processed_events p \
             ON p.event_id = v.column1 AND p.handler = v.column2 \
         WHERE p.owner = v.column3 AND p.started_at = ? AND p.status = 'in_progress' AND p.attempts = 0",
        vec!["(?, ?, ?)"; claims.len()].join(", ")
    );
    let mut query = sqlx::query_as(AssertSqlSafe(sql));
    for (key, handler, owner) in claims {
        query = query.bind(key).bind(*handler).bind(*owner);
    }
    Ok(query.bind(now).fetch_all(tx.conn()).await?.into_iter().collect())
}

/// How far apart (in row ids) the positions of handlers claiming together may be for one read
/// of the outbox to serve them all; farther ones are read apart, so that a handler far behind
/// does not make the others read what it has to catch up on.
const SHARED_READ_SPAN: i64 = 1024;

/// Groups sorted, distinct positions into `(lowest, highest)` ranges, each served by one read.
fn shared_reads(starts: &[i64]) -> Vec<(i64, i64)> {
    let mut reads: Vec<(i64, i64)> = Vec::new();
    for &start in starts {
        match reads.last_mut() {
            Some((first, last)) if start - *first <= SHARED_READ_SPAN => *last = start,
            _ => reads.push((start, start)),
        }
    }
    reads
}

/// Reads the contents of the claimed rows: row id → (type, aggregate, payload).
async fn load(tx: &mut WriteTx, mut row_ids: Vec<i64>) -> Result<HashMap<i64, (String, String, Vec<u8>)>, sqlx::Error> {
    row_ids.sort_unstable();
    row_ids.dedup();
    let mut rows = HashMap::with_capacity(row_ids.len());
    for chunk in row_ids.chunks(500) {
        let sql = format!(
            "SELECT id, event_type, aggregate_id, payload FROM event_queue WHERE id IN ({})",
            vec!["?"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for row_id in chunk {
            query = query.bind(row_id);
        }
        rows.extend(query.fetch_all(tx.conn()).await?.into_iter().map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3)))));
    }
    Ok(rows)
}

/// Settles deliveries of one handler, each conditioned on its token.
pub async fn settle(
    tx: &mut WriteTx,
    handler: &str,
    settlements: &[Settlement],
    now: i64,
    policy: HandlerPolicy,
) -> Result<Settled, sqlx::Error> {
    let mut settled = settle_many(tx, &[(handler, settlements)], now, policy).await?;
    Ok(settled.pop().expect("one answer per request"))
}

/// What [`settle`] does for each (handler, settlements), with every `Done` of them in one
/// statement (a few, for large batches): the common case, once per (event, handler).
pub async fn settle_many(
    tx: &mut WriteTx,
    requests: &[(&str, &[Settlement])],
    now: i64,
    policy: HandlerPolicy,
) -> Result<Vec<Settled>, sqlx::Error> {
    let done: Vec<(&str, &Settlement)> = requests
        .iter()
        .flat_map(|(handler, settlements)| settlements.iter().map(move |s| (*handler, s)))
        .filter(|(_, s)| s.outcome == DeliveryOutcome::Done)
        .collect();
    let mut marked: HashSet<(String, String, i64)> = HashSet::new();
    for chunk in done.chunks(300) {
        let values = vec!["(?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!(
            "UPDATE processed_events SET status = 'done', processed_at = ?, owner = NULL FROM (VALUES {values}) AS v \
             WHERE processed_events.event_id = v.column1 AND processed_events.handler = v.column2 \
             AND processed_events.started_at = v.column3 AND processed_events.status = 'in_progress'"
        );
        let mut update = sqlx::query(AssertSqlSafe(sql)).bind(now);
        for (handler, s) in chunk {
            update = update.bind(&s.key).bind(*handler).bind(s.token);
        }
        let keys = chunk.iter().map(|(handler, s)| (s.key.clone(), handler.to_string(), s.token));
        // Every delivery still held is the common case, and needs no rows back; otherwise the
        // ones this update marked (done now, under their token) are read back.
        if update.execute(tx.conn()).await?.rows_affected() as usize == chunk.len() {
            marked.extend(keys);
            continue;
        }
        let sql = format!(
            "SELECT p.event_id, p.handler, p.started_at FROM (VALUES {values}) AS v JOIN processed_events p \
                 ON p.event_id = v.column1 AND p.handler = v.column2 \
             WHERE p.started_at = v.column3 AND p.status = 'done' AND p.processed_at = ?"
        );
        let mut query = sqlx::query_as(AssertSqlSafe(sql));
        for (handler, s) in chunk {
            query = query.bind(&s.key).bind(*handler).bind(s.token);
        }
        let rows: Vec<(String, String, i64)> = query.bind(now).fetch_all(tx.conn()).await?;
        marked.extend(rows);
    }
    let mut answers = Vec::with_capacity(requests.len());
    for (handler, settlements) in requests {
        let mut settled = Settled::default();
        for s in settlements.iter() {
            let changed = match &s.outcome {
                DeliveryOutcome::Done => u64::from(marked.contains(&(s.key.clone(), handler.to_string(), s.token))),
                DeliveryOutcome::Deferred { until_ms } => sqlx::query(
                    "UPDATE processed_events SET status = 'retry', available_at = ?, owner = NULL \
                     WHERE event_id = ? AND handler = ? AND started_at = ? AND status = 'in_progress'",
                )
                .bind(until_ms)
                .bind(&s.key)
                .bind(handler)
                .bind(s.token)
                .execute(tx.conn())
                .await?
                .rows_affected(),
                DeliveryOutcome::Failed { error, terminal } => {
                    let held: Option<i64> = sqlx::query_scalar(
                        "SELECT attempts FROM processed_events \
                         WHERE event_id = ? AND handler = ? AND started_at = ? AND status = 'in_progress'",
                    )
                    .bind(&s.key)
                    .bind(handler)
                    .bind(s.token)
                    .fetch_optional(tx.conn())
                    .await?;
                    match held {
                        None => 0,
                        Some(attempts) => {
                            let attempts = attempts as u32 + 1;
                            let error = reelay_domain::clip_error(error);
                            let dead = *terminal || attempts >= policy.max_attempts;
                            let (status, due) = if dead {
                                tracing::error!(event_id = %s.key, handler, attempts, %error, "delivery dead-lettered for this handler");
                                settled.dead_lettered.push(s.key.clone());
                                ("dead_lettered", None)
                            } else {
                                ("retry", Some(now + policy.retry.delay(attempts).as_millis() as i64))
                            };
                            sqlx::query(
                                "UPDATE processed_events SET status = ?, attempts = ?, available_at = ?, last_error = ?, owner = NULL, \
                                 processed_at = COALESCE(?, processed_at) WHERE event_id = ? AND handler = ?",
                            )
                            .bind(status)
                            .bind(i64::from(attempts))
                            .bind(due)
                            .bind(error)
                            .bind(dead.then_some(now))
                            .bind(&s.key)
                            .bind(handler)
                            .execute(tx.conn())
                            .await?
                            .rows_affected()
                        }
                    }
                }
            };
            if changed == 0 {
                settled.lost.push(s.key.clone());
            } else {
                settled.settled += 1;
            }
        }
        answers.push(settled);
    }
    Ok(answers)
}

/// The owner is still at work on these claims: pushes their leases out. Returns the keys no
/// longer held under the given tokens.
pub async fn renew(
    tx: &mut WriteTx,
    handler: &str,
    keys: &[(String, i64)],
    now: i64,
) -> Result<Vec<String>, sqlx::Error> {
    let mut lost = Vec::new();
    for chunk in keys.chunks(200) {
        let sql = format!(
            "UPDATE processed_events SET renewed_at = ? WHERE handler = ? AND status = 'in_progress' \
             AND (event_id, started_at) IN (VALUES {}) RETURNING event_id",
            vec!["(?, ?)"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(now).bind(handler);
        for (key, token) in chunk {
            query = query.bind(key).bind(token);
        }
        let renewed: Vec<String> = query.fetch_all(tx.conn()).await?.into_iter().map(|r| r.get(0)).collect();
        lost.extend(chunk.iter().filter(|(key, _)| !renewed.contains(key)).map(|(key, _)| key.clone()));
    }
    Ok(lost)
}

/// Hands the claimer of `claim` back the deliveries of its handler that its calls `unanswered`
/// claimed (their answers never reached it) and it still holds, oldest first within the claim's
/// rows and bytes (the bytes its own or shared, as for a claim): their leases are renewed, they
/// are marked as claimed by `claim.call`, and they come back as they were handed (same tokens
/// and attempts, payloads read again). The others (settled, released, taken over since, their
/// outbox row gone, or over the budget) are left as they are. The caller must know that the
/// owner runs none of them (it never heard of them) and that none of those calls is still
/// claiming.
pub async fn resume(
    tx: &mut WriteTx,
    claim: &HandlerClaim,
    unanswered: &[u64],
    now: i64,
) -> Result<Vec<ClaimedDelivery>, sqlx::Error> {
    let (calls, placeholders) = claim_calls(unanswered);
    if calls.is_empty() {
        return Ok(Vec::new());
    }
    let handler = claim.handler.as_str();
    let sql = format!(
        "SELECT event_id, started_at, attempts FROM processed_events WHERE handler = ? \
         AND status IN ('in_progress', 'retry') AND status = 'in_progress' AND owner = ? \
         AND claim_call IN ({placeholders})"
    );
    let mut query = sqlx::query_as::<_, (String, i64, i64)>(AssertSqlSafe(sql)).bind(handler).bind(&claim.owner);
    for call in &calls {
        query = query.bind(call);
    }
    let held = query.fetch_all(tx.conn()).await?;
    let rows = outbox_rows_of(tx, held.iter().map(|(key, _, _)| key.as_str())).await?;
    let mut held: Vec<(i64, i64, String, i64, i64)> = held
        .into_iter()
        .filter_map(|(key, token, attempts)| {
            rows.get(&key).map(|&(row_id, length)| (row_id, length, key, token, attempts))
        })
        .collect();
    held.sort_unstable();
    let mut budget = Budget::of(claim);
    held.retain(|(_, length, ..)| budget.take(*length));
    let mut loaded = load(tx, held.iter().map(|h| h.0).collect()).await?;
    let mut resumed = Vec::with_capacity(held.len());
    for (row_id, _, key, token, attempts) in held {
        let Some((event_type, aggregate_id, payload)) = loaded.remove(&row_id) else { continue };
        let attempt = attempts as u32 + 1;
        resumed.push(ClaimedDelivery { row_id, key, event_type, aggregate_id, payload, attempt, token });
    }
    // Renewed in the same transaction as the look above: nothing settles them in between.
    for chunk in resumed.chunks(200) {
        let sql = format!(
            "UPDATE processed_events SET renewed_at = ?, claim_call = ? WHERE handler = ? AND status = 'in_progress' \
             AND (event_id, started_at) IN (VALUES {})",
            vec!["(?, ?)"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(now).bind(claim_call(claim.call)).bind(handler);
        for d in chunk {
            query = query.bind(&d.key).bind(d.token);
        }
        query.execute(tx.conn()).await?;
    }
    Ok(resumed)
}

/// An owner is `<instance>#<run>`; the instance's prefix is compared exactly (`LIKE` ignores the
/// case of ASCII letters: it would hand back a live `Worker-1`'s claims for `worker-1`).
/// With `?4`, the db backend's most attempts, each release spends one (see [`claim_open`]), and a
/// delivery out of attempts is dead-lettered with `?5`; without it (the ledger's claims, on
/// nats, whose deliveries JetStream counts) nothing is counted.
pub(crate) const RELEASE_DELIVERIES: &str = "UPDATE processed_events SET \
     status = CASE WHEN attempts + 1 >= ?4 THEN 'dead_lettered' ELSE 'retry' END, \
     attempts = attempts + (?4 IS NOT NULL), available_at = ?1, owner = NULL, \
     processed_at = CASE WHEN attempts + 1 >= ?4 THEN ?1 ELSE processed_at END, \
     last_error = CASE WHEN attempts + 1 >= ?4 THEN ?5 ELSE last_error END \
     WHERE status IN ('in_progress', 'retry') AND status = 'in_progress' AND substr(owner, 1, length(?2)) = ?2 \
     AND owner != ?3";

/// Claims still held by an earlier run of `instance` (its process died): handed back at once,
/// instead of waiting out their leases. Covers per-handler deliveries, ledger claims (nats
/// backend) and the relay's outbox rows. Returns how many. On db (`max_attempts` given) each
/// delivery handed back spends an attempt, as a lease run out does: an event that kills its
/// process is given up after that many, instead of killing each restart.
///
/// Only sound if no two live processes share an instance name (the `reelay` binary keeps the
/// names of the live processes of one data dir apart with lock files).
pub async fn release_instance(
    tx: &mut WriteTx,
    instance: &str,
    me: &str,
    now: i64,
    max_attempts: Option<u32>,
) -> Result<u64, sqlx::Error> {
    let prefix = format!("{instance}#");
    let reason = max_attempts.map(|most| stopped_during(i64::from(most)));
    let deliveries = sqlx::query(RELEASE_DELIVERIES)
        .bind(now)
        .bind(&prefix)
        .bind(me)
        .bind(max_attempts.map(i64::from))
        .bind(reason)
        .execute(tx.conn())
        .await?
        .rows_affected();
    let rows = sqlx::query(
        "UPDATE event_queue SET status = 'pending', claimed_by = NULL \
         WHERE status = 'processing' AND substr(claimed_by, 1, length(?1)) = ?1 AND claimed_by != ?2",
    )
    .bind(&prefix)
    .bind(me)
    .execute(tx.conn())
    .await?
    .rows_affected();
    Ok(deliveries + rows)
}

/// Where one handler stands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerStats {
    pub handler: String,
    /// Outbox rows after its cursor (of any type): not yet looked at.
    pub behind: u64,
    /// When the first of those was written (ms): outbox rows are numbered in the order they are
    /// written, so the first is the one that has waited longest. None when it is not behind.
    pub first_behind_at: Option<i64>,
    pub in_progress: u64,
    pub retrying: u64,
    pub dead_lettered: u64,
    /// Whether the write service delivers to it (in its build or --handler list at its start).
    pub delivered: bool,
}

/// Every handler's standing, read every time Prometheus scrapes, so it must stay cheap with a
/// large backlog and many handlers. Counting the rows after each cursor apart would walk the
/// backlog once per handler (most handlers stand close together, so it is nearly the same walk
/// each time). Instead the cursors are put in order and the rows between each one and the next
/// are counted (each row once, through the covering index of `(status, id)`, which holds every
/// row under one of the four statuses an outbox row can have); a handler is behind by the sum
/// of the stretches from its cursor on. Ties share a stretch: the first of them counts nothing.
pub(crate) const STATS: &str = "WITH ordered AS ( \
         SELECT handler, position, ROW_NUMBER() OVER w AS n, LEAD(position) OVER w AS next \
             FROM handler_cursors WINDOW w AS (ORDER BY position, handler)), \
     stretches AS ( \
         SELECT handler, position, n, CASE WHEN ?1 THEN (SELECT COUNT(*) FROM event_queue q \
             WHERE q.status IN ('pending', 'processing', 'done', 'dead_lettered') \
                 AND q.id > o.position AND q.id <= COALESCE(o.next, 9223372036854775807)) ELSE 0 END AS rows \
         FROM ordered o), \
     cursors AS ( \
         SELECT handler, position, SUM(rows) OVER (ORDER BY n DESC ROWS UNBOUNDED PRECEDING) AS behind \
             FROM stretches) \
     SELECT c.handler, c.behind, \
        (SELECT f.created_at FROM event_queue f WHERE f.id > c.position ORDER BY f.id LIMIT 1), \
        (SELECT COUNT(*) FROM processed_events p \
             WHERE p.handler = c.handler AND p.status IN ('in_progress', 'retry') AND p.status = 'in_progress'), \
        (SELECT COUNT(*) FROM processed_events p \
             WHERE p.handler = c.handler AND p.status IN ('in_progress', 'retry') AND p.status = 'retry'), \
        (SELECT COUNT(*) FROM processed_events p WHERE p.handler = c.handler AND p.status = 'dead_lettered'), \
        (SELECT h.delivered FROM handler_cursors h WHERE h.handler = c.handler) \
     FROM cursors c ORDER BY c.handler";

/// Where each registered handler stands. `cursors`: the db backend, where a handler's backlog is
/// the rows after its cursor; on nats the cursors never move (the backlog is its consumer's),
/// and counting after them would read every retained row for nothing (`behind` is 0 there).
pub async fn stats(conn: &mut sqlx::SqliteConnection, cursors: bool) -> Result<Vec<HandlerStats>, sqlx::Error> {
    let rows = sqlx::query(STATS).bind(cursors).fetch_all(conn).await?;
    Ok(rows
        .into_iter()
        .map(|r| HandlerStats {
            handler: r.get(0),
            behind: r.get::<i64, _>(1) as u64,
            first_behind_at: r.get(2),
            in_progress: r.get::<i64, _>(3) as u64,
            retrying: r.get::<i64, _>(4) as u64,
            dead_lettered: r.get::<i64, _>(5) as u64,
            delivered: r.get(6),
        })
        .collect())
}

// SQLite uses a partial index only for a query whose WHERE contains the index's condition as
// written; without one, a look for open deliveries reads every row the ledger keeps (most of
// them done). So queries for claims say `status IN ('in_progress', 'retry')`, the condition of
// the index of open deliveries (`processed_events_open`: handler, status, renewed_at), even next
// to a narrower one; queries for retries alone say `status = 'retry'`, the condition of the
// index of retries by due time (`processed_events_retry`: handler, available_at).

/// The open deliveries (due retries and claims whose lease ran out) of `handlers` handlers,
/// at most `?` per handler, oldest first.
pub(crate) fn claim_open_sql(handlers: usize) -> String {
    // ?1..?n the handlers, then now, the lease's cutoff and the most rows per handler. Due
    // retries and expired claims are read apart, each as one range of its index.
    let names = (1..=handlers).map(|i| format!("?{i}")).collect::<Vec<_>>().join(", ");
    let (now, stale, most) = (handlers + 1, handlers + 2, handlers + 3);
    format!(
        "SELECT handler, event_id, attempts, started_at, status, owner FROM ( \
             SELECT handler, event_id, attempts, started_at, status, owner, \
                 row_number() OVER (PARTITION BY handler ORDER BY started_at) AS n FROM ( \
                 SELECT handler, event_id, attempts, started_at, status, owner FROM processed_events \
                     WHERE handler IN ({names}) AND status = 'retry' AND available_at <= ?{now} \
                 UNION ALL \
                 SELECT handler, event_id, attempts, started_at, status, owner FROM processed_events \
                     WHERE handler IN ({names}) AND status IN ('in_progress', 'retry') AND status = 'in_progress' \
                         AND renewed_at < ?{stale})) \
         WHERE n <= ?{most} ORDER BY handler, n"
    )
}

/// Whether any of the handlers (a JSON array, ?1) has anything to claim now, and the earliest
/// next retry of any of them.
pub(crate) const PEEK: &str = "SELECT COALESCE(MAX(due), 0), MIN(next) FROM (SELECT \
         EXISTS (SELECT 1 FROM event_queue WHERE id > (SELECT position FROM handler_cursors WHERE handler = h.value)) \
         OR EXISTS (SELECT 1 FROM processed_events WHERE handler = h.value AND status = 'retry' AND available_at <= ?2) \
         OR EXISTS (SELECT 1 FROM processed_events \
             WHERE handler = h.value AND status IN ('in_progress', 'retry') AND status = 'in_progress' AND renewed_at < ?3) \
             AS due, \
        (SELECT MIN(available_at) FROM processed_events WHERE handler = h.value AND status = 'retry') AS next \
     FROM json_each(?1) h)";

/// A read-only look for an idle claimer: whether any of the handlers has anything to claim
/// now, and when the first of their next retries is due. `lease_counted_from` is the writer's
/// ([`crate::Writer::lease_counted_from`]), so a look finds due what a claim would take over.
pub async fn peek(
    conn: &mut sqlx::SqliteConnection,
    handlers: &[String],
    now: i64,
    policy: HandlerPolicy,
    lease_counted_from: i64,
) -> Result<(bool, Option<i64>), sqlx::Error> {
    let names = serde_json::to_string(handlers).expect("strings serialize");
    let stale = crate::stale_before(lease_counted_from, now, policy.lease);
    let row = sqlx::query(PEEK).bind(names).bind(now).bind(stale).fetch_one(conn).await?;
    Ok((row.get(0), row.get(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::TestError;
    use crate::{Database, DbConfig};

    /// A restarted instance takes back its own predecessors' claims only: not a live process
    /// whose name differs in the case of a letter or goes on after it, nor its own run's; and
    /// `%` or `_` in a name are letters like the others.
    #[tokio::test]
    async fn an_instance_takes_back_only_its_own_claims() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        let owners = ["worker-1#old", "Worker-1#live", "worker-10#live", "worker-1#me", "a%_#old", "abc#live"];
        let released = db
            .writer
            .transact::<_, TestError, _>("release", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    for (n, owner) in owners.iter().enumerate() {
                        sqlx::query(
                            "INSERT INTO processed_events (event_id, handler, status, started_at, renewed_at, owner) \
                             VALUES (?, 'h', 'in_progress', 1, 1, ?)",
                        )
                        .bind(format!("e{n}"))
                        .bind(owner)
                        .execute(tx.conn())
                        .await?;
                        sqlx::query(
                            "INSERT INTO event_queue (event_id, event_type, payload, status, available_at, created_at, \
                             claimed_at, claimed_by) VALUES (?, 'T', x'00', 'processing', 1, 1, 1, ?)",
                        )
                        .bind(format!("e{n}"))
                        .bind(owner)
                        .execute(tx.conn())
                        .await?;
                    }
                    let mine = release_instance(tx, "worker-1", "worker-1#me", 5, None).await?;
                    let odd = release_instance(tx, "a%_", "a%_#me", 5, None).await?;
                    Ok((mine, odd))
                })
            })
            .await
            .unwrap();
        assert_eq!(released, (2, 2), "one delivery and one outbox row each");
        let held: Vec<String> =
            sqlx::query_scalar("SELECT owner FROM processed_events WHERE status = 'in_progress' ORDER BY owner")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        assert_eq!(held, ["Worker-1#live", "abc#live", "worker-1#me", "worker-10#live"]);
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT claimed_by FROM event_queue WHERE status = 'processing' ORDER BY claimed_by")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        assert_eq!(rows, held);
    }

    /// A retire is one job: refused while a process is heard from, it discards nothing; done,
    /// it discards the dead letters (each recorded with its attempts and error, as an
    /// operator's discard is) and the open deliveries, and drops the cursor and builds.
    #[tokio::test]
    async fn a_refused_retire_changes_nothing_and_a_done_one_records_each_dead_letter() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        let lease = Duration::from_secs(1);
        // Retires `gone` at a time its builds were last heard from `ago` ms before.
        let retire_heard = |ago: i64| {
            db.writer.transact::<_, TestError, _>("retire", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    let now = tx.lease_counted_from() + 100 * build_live_span(lease);
                    sqlx::query("UPDATE handler_builds SET last_seen = ?").bind(now - ago).execute(tx.conn()).await?;
                    Ok(retire(tx, "gone", "ops", now, lease).await.map_err(|e| e.to_string()))
                })
            })
        };
        db.writer
            .transact::<_, TestError, _>("seed", |tx: &mut WriteTx| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO handler_cursors (handler, position, created_at, updated_at, delivered) \
                         VALUES ('gone', 0, 1, 1, 0)",
                    )
                    .execute(tx.conn())
                    .await?;
                    sqlx::query(
                        "INSERT INTO handler_builds (handler, event_types, first_seen, last_seen) \
                         VALUES ('gone', '[]', 1, 1)",
                    )
                    .execute(tx.conn())
                    .await?;
                    for (event_id, status) in [("e1", "dead_lettered"), ("e2", "dead_lettered"), ("e3", "retry")] {
                        sqlx::query(
                            "INSERT INTO processed_events (event_id, handler, status, attempts, last_error, \
                             started_at, available_at) VALUES (?, 'gone', ?, 5, 'boom', 1, 1)",
                        )
                        .bind(event_id)
                        .bind(status)
                        .execute(tx.conn())
                        .await?;
                    }
                    Ok(())
                })
            })
            .await
            .unwrap();
        let statuses = || async {
            let rows: Vec<(String, String, Option<String>)> =
                sqlx::query_as("SELECT event_id, status, last_error FROM processed_events ORDER BY event_id")
                    .fetch_all(&db.reads)
                    .await
                    .unwrap();
            rows
        };
        let actions = || async {
            let rows: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(
                "SELECT action, event_id, attempts, last_error FROM dead_letter_actions ORDER BY event_id",
            )
            .fetch_all(&db.reads)
            .await
            .unwrap();
            rows
        };
        let before = statuses().await;

        // Heard from a moment ago: refused, and nothing changed.
        let refused = retire_heard(1).await.unwrap();
        assert!(refused.as_ref().is_err_and(|e| e.contains("still run by a process")), "{refused:?}");
        assert_eq!(statuses().await, before);
        assert!(actions().await.is_empty());

        // Not heard from for longer than a build stays live: retired.
        let retired = retire_heard(2 * build_live_span(lease)).await;
        assert_eq!(retired.unwrap(), Ok(Retired { dead_letters: 2, open: 1 }));
        let discarded = |id: &str, error: &str| (id.to_owned(), "discarded".to_owned(), Some(error.to_owned()));
        assert_eq!(
            statuses().await,
            [discarded("e1", "boom"), discarded("e2", "boom"), discarded("e3", "handler retired by ops")]
        );
        let recorded = |id: &str| ("discard".to_owned(), id.to_owned(), 5, Some("boom".to_owned()));
        assert_eq!(actions().await, [recorded("e1"), recorded("e2")]);
        let left: i64 = sqlx::query_scalar(
            "SELECT (SELECT COUNT(*) FROM handler_cursors WHERE handler = 'gone') + \
             (SELECT COUNT(*) FROM handler_builds WHERE handler = 'gone')",
        )
        .fetch_one(&db.reads)
        .await
        .unwrap();
        assert_eq!(left, 0, "its cursor and builds are gone");
    }
}
