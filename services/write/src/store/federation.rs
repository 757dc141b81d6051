//! Federation: what arrives over ActivityPub (remote reviews, follows, their undoing, accepts of
//! our follows), the deliveries queued for remote inboxes, and local users as actors.
//!
//! Inbound writes that name the activity that carried them record it in `federation_inbox` in
//! the same transaction: a repeat delivery of one activity changes nothing, whatever happened
//! in between (a Follow redelivered after its Undo does not follow again). An activity that
//! finds nothing to change (an Undo of no follow in force, a Delete from an actor nobody here
//! follows) is not recorded: any server can send those.

use std::collections::HashSet;
use std::time::Duration;

use reelay_activitypub::documents::server_of;
use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{NewEvent, ReviewId, UserId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;
use sqlx::{FromRow, Row, SqliteConnection};

use super::reviews::delete_if_orphan;
use super::{
    RemoteReview, RemoteReviewSaved, Result, ReviewRow, Store, Target, UserRow, commit_events, ensure_user, is_blocked,
    resolve_movie, write_job,
};

/// Records that the inbox took in `activity` from `actor_uri`; false when it had already (the
/// caller then changes nothing). No activity id: always true.
///
/// A repeat is the same actor's: any actor of a server can sign an activity under any id there,
/// so one actor sending another's coming activity id (a Mastodon account's Delete is
/// `<actor>#delete`) must not make that activity a repeat. Records from before they had an
/// actor (`''`) count as any actor's.
async fn first_delivery(tx: &mut WriteTx, actor_uri: &str, activity: &Option<String>) -> Result<bool> {
    let Some(activity) = activity else { return Ok(true) };
    let inserted = sqlx::query(
        "INSERT INTO federation_inbox (activity_id, actor_uri, received_at) SELECT ?1, ?2, ?3 \
         WHERE NOT EXISTS (SELECT 1 FROM federation_inbox WHERE activity_id = ?1 AND actor_uri IN (?2, ''))",
    )
    .bind(activity.clone())
    .bind(actor_uri.to_owned())
    .bind(tx.now_ms())
    .execute(tx.conn())
    .await?
    .rows_affected();
    if inserted > 0
        && let Some(server) = server_of(activity)
    {
        // The server it came from is up: the gateway took it signed by an actor there, or
        // fetched the 410 of a gone actor there itself.
        server_answered(tx.conn(), &server).await?;
    }
    Ok(inserted > 0)
}

/// When a fan-out to followers leaves a server's inboxes out.
#[derive(Debug, Clone, Copy)]
pub struct ServerPolicy {
    /// How long a server fails every delivery before it is unavailable (`None`: never).
    pub unavailable_after: Option<Duration>,
    /// How often a fan-out lets one delivery through to an unavailable server, as a probe.
    pub probe_every: Duration,
}

impl ServerPolicy {
    /// Whether unavailable servers are left out at all (the setting not 0): with it off, none
    /// is, whatever was recorded before.
    pub fn leaves_out(&self) -> bool {
        self.unavailable_after.is_some()
    }
}

impl Default for ServerPolicy {
    fn default() -> Self {
        Self { unavailable_after: Some(Duration::from_secs(7 * 86_400)), probe_every: Duration::from_secs(3600) }
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Forgets `server`'s failed deliveries: it answered. Whether it had any.
async fn server_answered(conn: &mut SqliteConnection, server: &str) -> Result<bool> {
    let was: Option<Option<i64>> =
        sqlx::query_scalar("DELETE FROM federation_failing_hosts WHERE host = ? RETURNING unavailable_since")
            .bind(server.to_owned())
            .fetch_optional(conn)
            .await?;
    match was {
        Some(Some(since)) => {
            tracing::info!(
                server,
                unavailable_since_ms = since,
                "an unavailable server answered: deliveries to it resume"
            );
        }
        Some(None) => tracing::info!(server, "a server that failed deliveries answered: its failures are cleared"),
        None => {}
    }
    Ok(was.is_some())
}

/// A server's failed deliveries, as `federation_failing_hosts` keeps them.
#[derive(FromRow)]
struct FailingServer {
    failing_since: i64,
    last_failure_at: i64,
    unavailable_since: Option<i64>,
}

impl FailingServer {
    /// The record after another failure at `now`. A gap longer than `after` between two
    /// failures (no delivery tried meanwhile) starts the count again: one failure a year ago and
    /// one today are not a server failing for a year. Unavailable once failing for `after`.
    fn failed_again(&self, now: i64, after: Option<Duration>) -> FailingServer {
        let after_ms = after.map(millis);
        let failing_since = match (self.unavailable_since, after_ms) {
            (None, Some(after)) if now - self.last_failure_at > after => now,
            _ => self.failing_since,
        };
        let unavailable_since = self.unavailable_since.or(match after_ms {
            Some(after) if now - failing_since >= after => Some(now),
            _ => None,
        });
        FailingServer { failing_since, last_failure_at: now.max(self.last_failure_at), unavailable_since }
    }
}

/// Whether the inbox took in `activity` before. For activities that change something only
/// when they find what they name (an Undo, an Accept, a Reject, a Delete of nothing kept): they
/// look first and record themselves only once they changed something, so any signer cannot
/// fill `federation_inbox` with ids that change nothing.
async fn seen_before(tx: &mut WriteTx, actor_uri: &str, activity: &Option<String>) -> Result<bool> {
    let Some(activity) = activity else { return Ok(false) };
    let seen: Option<i64> =
        sqlx::query_scalar("SELECT 1 FROM federation_inbox WHERE activity_id = ?1 AND actor_uri IN (?2, '') LIMIT 1")
            .bind(activity.clone())
            .bind(actor_uri.to_owned())
            .fetch_optional(tx.conn())
            .await?;
    Ok(seen.is_some())
}

/// Deletes up to `batch` rows of each of the federation's dedup records (activities taken in,
/// activities queued out, deleted remote reviews) written before `cutoff_ms`, and of the
/// servers whose last failure was before `servers_cutoff_ms`; says how many went. Past those, a
/// peer has long stopped retrying what they guard against, and a server not tried for that long
/// (no fan-out to it, not even a probe: nobody here posts to its followers) starts its count
/// over at its next failure.
pub(crate) async fn purge_records(
    tx: &mut WriteTx,
    cutoff_ms: i64,
    servers_cutoff_ms: i64,
    batch: u32,
) -> std::result::Result<u64, sqlx::Error> {
    let mut purged = 0;
    for (table, key, at, cutoff) in [
        ("federation_inbox", "activity_id, actor_uri", "received_at", cutoff_ms),
        ("federation_outbox", "activity_id", "created_at", cutoff_ms),
        ("remote_review_tombstones", "object_uri, actor_uri", "deleted_at", cutoff_ms),
        ("federation_failing_hosts", "host", "last_failure_at", servers_cutoff_ms),
    ] {
        purged += sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE ({key}) IN (SELECT {key} FROM {table} WHERE {at} < ?1 ORDER BY {at} LIMIT ?2)"
        )))
        .bind(cutoff)
        .bind(i64::from(batch))
        .execute(tx.conn())
        .await?
        .rows_affected();
    }
    Ok(purged)
}

async fn followed_by_anyone(conn: &mut SqliteConnection, actor_uri: &str) -> Result<bool> {
    Ok(sqlx::query("SELECT 1 FROM follows WHERE target = ? LIMIT 1")
        .bind(Target::Actor(actor_uri.to_owned()).key())
        .fetch_optional(conn)
        .await?
        .is_some())
}

/// Records that `actor_uri`'s remote review `object_uri` is deleted, so a Create or Update of it
/// by that actor arriving later is not saved. (Another actor of its server deleting it first
/// keeps nothing out: only its author's Delete does.)
async fn tombstone(tx: &mut WriteTx, object_uri: &str, actor_uri: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO remote_review_tombstones (object_uri, actor_uri, deleted_at) VALUES (?, ?, ?) \
         ON CONFLICT (object_uri, actor_uri) DO NOTHING",
    )
    .bind(object_uri.to_owned())
    .bind(actor_uri.to_owned())
    .bind(tx.now_ms())
    .execute(tx.conn())
    .await?;
    Ok(())
}

/// A remote review deleted (by its author, or with its author's account).
fn remote_review_deleted(id: &str, object_uri: String, actor_uri: &str, movie_id: &str) -> NewEvent {
    NewEvent::new(
        id,
        Payload::RemoteReviewDeleted(v1::RemoteReviewDeleted {
            remote_review_id: id.to_owned(),
            object_uri,
            actor_uri: actor_uri.to_owned(),
            movie_id: movie_id.to_owned(),
        }),
    )
}

/// A remote actor's follow of `user_id` ended (its Undo, its inbox gone, its account deleted).
fn remote_follow_undone(actor_uri: &str, user_id: &str, activity_uri: String) -> NewEvent {
    let payload = v1::RemoteFollowUndone { actor_uri: actor_uri.to_owned(), user_id: user_id.to_owned(), activity_uri };
    NewEvent::new(user_id, Payload::RemoteFollowUndone(payload))
}

/// A local user's follow of a remote actor ended by the actor (its Reject, its account
/// deleted): `rejected`, so no Undo is sent back.
fn follow_ended_by_remote(follower_id: &str, target: &Target, follow_event_id: String) -> NewEvent {
    let payload = v1::Unfollowed {
        follower_id: follower_id.to_owned(),
        target: Some(target.to_proto()),
        follow_event_id,
        rejected: true,
    };
    NewEvent::new(follower_id, Payload::Unfollowed(payload))
}

/// Reviews of a deleted account deleted per write job.
const ACTOR_REVIEWS_PER_JOB: usize = 500;

/// Deletes up to [`ACTOR_REVIEWS_PER_JOB`] of `actor_uri`'s kept reviews, each tombstoned, with
/// the films only they named; returns their events and how many went.
async fn delete_reviews_of(tx: &mut WriteTx, actor_uri: &str) -> Result<(Vec<NewEvent>, usize)> {
    let rows = sqlx::query(
        "DELETE FROM remote_reviews WHERE id IN (SELECT id FROM remote_reviews WHERE actor_uri = ?1 LIMIT ?2) \
         RETURNING id, object_uri, movie_id",
    )
    .bind(actor_uri.to_owned())
    .bind(ACTOR_REVIEWS_PER_JOB as i64)
    .fetch_all(tx.conn())
    .await?;
    let mut events = Vec::with_capacity(rows.len());
    let mut movies = std::collections::BTreeSet::new();
    for row in &rows {
        let (id, object_uri, movie_id): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        tombstone(tx, &object_uri, actor_uri).await?;
        events.push(remote_review_deleted(&id, object_uri, actor_uri, &movie_id));
        movies.insert(movie_id);
    }
    // Once the reviews are gone: a film only they named goes with them.
    for movie_id in &movies {
        events.extend(delete_if_orphan(tx.conn(), movie_id).await?);
    }
    Ok((events, rows.len()))
}

/// What queueing an activity did.
#[derive(Debug, Default)]
pub struct Queued {
    pub queued: u32,
    /// Followers' inboxes left out: their server is unavailable.
    pub skipped_unavailable: u32,
    /// The review the activity is about is gone: nothing queued.
    pub review_gone: bool,
}

/// Who receives one activity.
pub enum Audience {
    /// Every remote follower of the sender, one delivery per shared inbox (or inbox).
    Followers,
    Inbox(String),
}

/// A local user as an actor.
pub struct LocalActorRow {
    pub user: UserRow,
    pub public_key_pem: String,
    pub followers: u64,
    pub reviews: u64,
}

/// A review in a user's outbox, with its movie.
pub struct OutboxRow {
    pub review: ReviewRow,
    pub movie_title: String,
    pub movie_year: i64,
    pub movie_external_id: Option<String>,
}

macro_rules! outbox_page {
    ($cursor:literal) => {
        concat!(
            "SELECT r.id, r.user_id, r.movie_id, r.rating, r.body, r.watched_on, r.rewatch, r.source, \
                    r.created_at, r.updated_at, m.title, m.year, m.external_id \
             FROM reviews r JOIN movies m ON m.id = r.movie_id WHERE r.user_id = ?1 AND ",
            $cursor,
            " ORDER BY r.id DESC LIMIT ?3"
        )
    };
}
/// A page of a user's outbox after a cursor, and the first page: two statements, as
/// [`super::reviews::DIARY_PAGE`].
pub(super) const OUTBOX_PAGE: &str = outbox_page!("r.id < ?2");
pub(super) const OUTBOX_FIRST_PAGE: &str = outbox_page!("?2 IS NULL");

impl Store {
    /// Saves a review that arrived over ActivityPub, keyed by its object id: a repeat delivery
    /// with the same content changes nothing, an update rewrites it. Only reviews of actors a
    /// local user follows are kept.
    pub async fn save_remote_review(
        &self,
        review: RemoteReview,
        received: Option<String>,
        keep_existing: bool,
    ) -> Result<RemoteReviewSaved> {
        write_job!(self, "save_remote_review", |tx| {
            if !followed_by_anyone(tx.conn(), &review.actor_uri).await? {
                return Err(ServiceError::failed_precondition(format!(
                    "actor_uri: nobody here follows {}",
                    review.actor_uri
                ))
                .into());
            }
            let unchanged = RemoteReviewSaved { id: String::new(), created: false, changed: false };
            if !first_delivery(tx, &review.actor_uri, &received).await? {
                return Ok(unchanged);
            }
            // Deleted by its author already (that Delete came first): a late Create or Update
            // must not bring it back.
            let deleted: Option<i64> =
                sqlx::query_scalar("SELECT 1 FROM remote_review_tombstones WHERE object_uri = ? AND actor_uri = ?")
                    .bind(review.object_uri.clone())
                    .bind(review.actor_uri.clone())
                    .fetch_optional(tx.conn())
                    .await?;
            if deleted.is_some() {
                tracing::info!(object_uri = %review.object_uri, "a review its author deleted arrived again; not saved");
                return Ok(unchanged);
            }
            let existing = sqlx::query(
                "SELECT id, actor_uri, movie_id, rating, body, published_at, edited_at FROM remote_reviews \
                 WHERE object_uri = ?",
            )
            .bind(review.object_uri.clone())
            .fetch_optional(tx.conn())
            .await?;
            if let Some(row) = &existing {
                if row.get::<String, _>("actor_uri") != review.actor_uri {
                    return Err(ServiceError::permission_denied(format!(
                        "object_uri {} belongs to another actor",
                        review.object_uri
                    ))
                    .into());
                }
                // Deliveries come in any order. A Create (after an Update of the same note) keeps
                // the copy unless its own edit is known to be later (an outbox read again after
                // Updates were refused while nobody followed); any save is refused by a copy
                // edited later.
                let edited_at: i64 = row.get("edited_at");
                let later = |a: i64, b: i64| a > 0 && b > 0 && a > b;
                if (keep_existing && !later(review.edited_at_ms, edited_at)) || later(edited_at, review.edited_at_ms) {
                    tracing::info!(object_uri = %review.object_uri, "an older copy of a review kept already; not saved");
                    return Ok(RemoteReviewSaved { id: row.get("id"), created: false, changed: false });
                }
            }
            let mut events = Vec::new();
            let (movie, _) = resolve_movie(tx, &review.movie, &mut events).await?;
            let now = tx.now_ms();
            // The film the review named before an update that names another.
            let mut left_movie = None;
            let (id, created) = match existing {
                Some(row) => {
                    let id: String = row.get("id");
                    let unchanged = row.get::<String, _>("movie_id") == movie.id
                        && row.get::<i64, _>("rating") == i64::from(review.rating)
                        && row.get::<String, _>("body") == review.body
                        && row.get::<i64, _>("published_at") == review.published_at_ms;
                    if unchanged {
                        // The same text, maybe from a later edit: an older one must not replace it.
                        sqlx::query("UPDATE remote_reviews SET edited_at = MAX(edited_at, ?) WHERE id = ?")
                            .bind(review.edited_at_ms)
                            .bind(id.clone())
                            .execute(tx.conn())
                            .await?;
                        commit_events(tx, events).await?;
                        return Ok(RemoteReviewSaved { id, created: false, changed: false });
                    }
                    sqlx::query("UPDATE remote_reviews SET movie_id = ?, rating = ?, body = ?, published_at = ?, updated_at = ?, \
                                 edited_at = MAX(edited_at, ?) WHERE id = ?")
                        .bind(movie.id.clone())
                        .bind(i64::from(review.rating))
                        .bind(review.body.clone())
                        .bind(review.published_at_ms)
                        .bind(now)
                        .bind(review.edited_at_ms)
                        .bind(id.clone())
                        .execute(tx.conn())
                        .await?;
                    left_movie = Some(row.get::<String, _>("movie_id")).filter(|old| *old != movie.id);
                    (id, false)
                }
                None => {
                    let id = ReviewId::new().to_string();
                    sqlx::query(
                        "INSERT INTO remote_reviews (id, object_uri, actor_uri, movie_id, rating, body, published_at, updated_at, \
                         edited_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    )
                    .bind(id.clone())
                    .bind(review.object_uri.clone())
                    .bind(review.actor_uri.clone())
                    .bind(movie.id.clone())
                    .bind(i64::from(review.rating))
                    .bind(review.body.clone())
                    .bind(review.published_at_ms)
                    .bind(now)
                    .bind(review.edited_at_ms)
                    .execute(tx.conn())
                    .await?;
                    (id, true)
                }
            };
            events.push(NewEvent::new(
                &id,
                Payload::RemoteReviewSaved(v1::RemoteReviewSaved {
                    remote_review_id: id.clone(),
                    object_uri: review.object_uri,
                    actor_uri: review.actor_uri,
                    movie_id: movie.id,
                    rating: review.rating,
                    body: review.body,
                    published_at_ms: review.published_at_ms,
                    movie_title: movie.title,
                    movie_year: movie.year as i32,
                }),
            ));
            if let Some(left) = left_movie {
                events.extend(delete_if_orphan(tx.conn(), &left).await?);
            }
            commit_events(tx, events).await?;
            Ok(RemoteReviewSaved { id, created, changed: true })
        })
        .await
    }

    /// Removes a remote review its author deleted; the movie goes with its last reference.
    pub async fn delete_remote_review(
        &self,
        object_uri: String,
        actor_uri: String,
        received: Option<String>,
    ) -> Result<bool> {
        write_job!(self, "delete_remote_review", |tx| {
            if seen_before(tx, &actor_uri, &received).await? {
                return Ok(false);
            }
            let row = sqlx::query("SELECT id, actor_uri, movie_id FROM remote_reviews WHERE object_uri = ?")
                .bind(object_uri.clone())
                .fetch_optional(tx.conn())
                .await?;
            if row.as_ref().is_some_and(|row| row.get::<String, _>("actor_uri") != actor_uri) {
                return Err(ServiceError::permission_denied(format!(
                    "object_uri {object_uri} belongs to another actor"
                ))
                .into());
            }
            // Nothing of the actor is kept, and nobody here follows it (so a Create of it would
            // not be saved either): nothing to delete, and nothing to remember.
            if row.is_none() && !followed_by_anyone(tx.conn(), &actor_uri).await? {
                return Ok(false);
            }
            first_delivery(tx, &actor_uri, &received).await?;
            // Found or not (its Create may still be on its way), it stays deleted.
            tombstone(tx, &object_uri, &actor_uri).await?;
            let Some(row) = row else { return Ok(false) };
            let (id, movie_id): (String, String) = (row.get("id"), row.get("movie_id"));
            sqlx::query("DELETE FROM remote_reviews WHERE id = ?").bind(id.clone()).execute(tx.conn()).await?;
            let mut events = vec![remote_review_deleted(&id, object_uri, &actor_uri, &movie_id)];
            events.extend(delete_if_orphan(tx.conn(), &movie_id).await?);
            commit_events(tx, events).await?;
            Ok(true)
        })
        .await
    }

    /// A remote actor deleted its account: every review of it kept here is deleted (tombstoned,
    /// so a Create of it still on its way is not saved), it follows nobody here, and nobody here
    /// follows it any more (ended as a Reject ends a follow: no Undo is sent to an account that
    /// is gone), so a review of it arriving later is not saved either. The reviews go in jobs of
    /// [`ACTOR_REVIEWS_PER_JOB`], the follows with the last; the activity is recorded there, so a
    /// repeat after a crash between jobs finishes the work. False when nothing of it was kept.
    pub async fn delete_remote_actor(&self, actor_uri: String, received: Option<String>) -> Result<bool> {
        let mut changed = false;
        loop {
            let (actor_uri, received) = (actor_uri.clone(), received.clone());
            let (changed_now, done) = write_job!(self, "delete_remote_actor", |tx| {
                if seen_before(tx, &actor_uri, &received).await? {
                    return Ok((false, true));
                }
                let (mut events, deleted) = delete_reviews_of(tx, &actor_uri).await?;
                if deleted == ACTOR_REVIEWS_PER_JOB {
                    commit_events(tx, events).await?;
                    return Ok((true, false));
                }
                let followers =
                    sqlx::query("DELETE FROM remote_followers WHERE actor_uri = ? RETURNING user_id, activity_uri")
                        .bind(actor_uri.clone())
                        .fetch_all(tx.conn())
                        .await?;
                for row in &followers {
                    events.push(remote_follow_undone(&actor_uri, row.get(0), row.get(1)));
                }
                let target = Target::Actor(actor_uri.clone());
                let follows = sqlx::query(
                    "DELETE FROM follows WHERE target = ? RETURNING follower_id, COALESCE(follow_event_id, '')",
                )
                .bind(target.key())
                .fetch_all(tx.conn())
                .await?;
                for row in &follows {
                    events.push(follow_ended_by_remote(row.get(0), &target, row.get(1)));
                }
                // Every deletion raised an event: whether this job changed anything.
                let changed_now = !events.is_empty();
                if changed_now || changed {
                    first_delivery(tx, &actor_uri, &received).await?;
                }
                commit_events(tx, events).await?;
                Ok((changed_now, true))
            })
            .await?;
            changed |= changed_now;
            if done {
                return Ok(changed);
            }
        }
    }

    /// A remote actor follows a local user. A new Follow from an actor already following (it
    /// lost track, say) becomes the Follow in force and is accepted again.
    pub async fn receive_follow(
        &self,
        actor_uri: String,
        user: UserId,
        activity_uri: String,
        inbox: Option<String>,
        shared_inbox: Option<String>,
    ) -> Result<bool> {
        write_job!(self, "receive_follow", |tx| {
            ensure_user(tx.conn(), user).await?;
            if is_blocked(tx.conn(), &user.to_string(), &Target::Actor(actor_uri.clone()).key()).await? {
                return Err(ServiceError::failed_precondition(format!(
                    "actor_uri: {actor_uri} is blocked by user {user}"
                ))
                .into());
            }
            if !first_delivery(tx, &actor_uri, &Some(activity_uri.clone())).await? {
                return Ok(false);
            }
            sqlx::query(
                "INSERT INTO remote_followers (user_id, actor_uri, activity_uri, created_at, inbox, shared_inbox) \
                 VALUES (?, ?, ?, ?, ?, ?) \
                 ON CONFLICT (user_id, actor_uri) DO UPDATE SET activity_uri = excluded.activity_uri, \
                     inbox = excluded.inbox, shared_inbox = excluded.shared_inbox",
            )
            .bind(user.to_string())
            .bind(actor_uri.clone())
            .bind(activity_uri.clone())
            .bind(tx.now_ms())
            .bind(inbox.clone())
            .bind(shared_inbox)
            .execute(tx.conn())
            .await?;
            let event = NewEvent::new(
                user,
                Payload::RemoteFollowReceived(v1::RemoteFollowReceived {
                    actor_uri,
                    user_id: user.to_string(),
                    activity_uri,
                    inbox: inbox.unwrap_or_default(),
                }),
            );
            commit_events(tx, vec![event]).await?;
            Ok(true)
        })
        .await
    }

    /// An Undo of a remote actor's Follow: removes the follow only when the Undo names the
    /// Follow in force (an Undo of an earlier Follow, or of one never seen, changes nothing).
    /// `user` may be unknown when the Undo carries only the Follow's id.
    pub async fn receive_undo(
        &self,
        actor_uri: String,
        user: Option<UserId>,
        activity_uri: String,
        received: Option<String>,
    ) -> Result<bool> {
        write_job!(self, "receive_undo", |tx| {
            if let Some(user) = user {
                ensure_user(tx.conn(), user).await?;
            }
            if seen_before(tx, &actor_uri, &received).await? {
                return Ok(false);
            }
            let removed: Vec<String> = sqlx::query(
                "DELETE FROM remote_followers WHERE actor_uri = ?1 AND activity_uri = ?2 AND (?3 IS NULL OR user_id = ?3) \
                 RETURNING user_id",
            )
            .bind(actor_uri.clone())
            .bind(activity_uri.clone())
            .bind(user.map(|u| u.to_string()))
            .fetch_all(tx.conn())
            .await?
            .into_iter()
            .map(|row| row.get(0))
            .collect();
            let events = removed
                .iter()
                .map(|user_id| remote_follow_undone(&actor_uri, user_id, activity_uri.clone()))
                .collect::<Vec<_>>();
            if removed.is_empty() {
                return Ok(false);
            }
            first_delivery(tx, &actor_uri, &received).await?;
            commit_events(tx, events).await?;
            Ok(true)
        })
        .await
    }

    /// A remote actor accepted the Follow a local user sent (named by the event its id derives
    /// from): the follow is in force from now on.
    pub async fn receive_accept(
        &self,
        actor_uri: String,
        follow_event_id: String,
        received: Option<String>,
    ) -> Result<bool> {
        write_job!(self, "receive_accept", |tx| {
            if seen_before(tx, &actor_uri, &received).await? {
                return Ok(false);
            }
            let accepted: Option<String> = sqlx::query(
                "UPDATE follows SET accepted_at = ? WHERE target = ? AND follow_event_id = ? AND accepted_at IS NULL \
                 RETURNING follower_id",
            )
            .bind(tx.now_ms())
            .bind(Target::Actor(actor_uri.clone()).key())
            .bind(follow_event_id)
            .fetch_optional(tx.conn())
            .await?
            .map(|row| row.get(0));
            let Some(follower_id) = accepted else { return Ok(false) };
            first_delivery(tx, &actor_uri, &received).await?;
            let event = NewEvent::new(
                &follower_id,
                Payload::RemoteFollowAccepted(v1::RemoteFollowAccepted { follower_id: follower_id.clone(), actor_uri }),
            );
            commit_events(tx, vec![event]).await?;
            Ok(true)
        })
        .await
    }

    /// A remote actor rejected a local user's Follow (or removed the follower): the follow that
    /// Follow made goes, as an unfollow does, whether it was accepted or not.
    pub async fn receive_reject(
        &self,
        actor_uri: String,
        follow_event_id: String,
        received: Option<String>,
    ) -> Result<bool> {
        write_job!(self, "receive_reject", |tx| {
            if seen_before(tx, &actor_uri, &received).await? {
                return Ok(false);
            }
            let target = Target::Actor(actor_uri.clone());
            let removed: Option<String> =
                sqlx::query("DELETE FROM follows WHERE target = ? AND follow_event_id = ? RETURNING follower_id")
                    .bind(target.key())
                    .bind(follow_event_id.clone())
                    .fetch_optional(tx.conn())
                    .await?
                    .map(|row| row.get(0));
            let Some(follower_id) = removed else { return Ok(false) };
            first_delivery(tx, &actor_uri, &received).await?;
            tracing::info!(%follower_id, %actor_uri, "a remote actor rejected a follow; it is removed");
            commit_events(tx, vec![follow_ended_by_remote(&follower_id, &target, follow_event_id)]).await?;
            Ok(true)
        })
        .await
    }

    /// Of `users`, those with a remote follower that has an inbox.
    pub async fn users_with_followers(&self, users: &[UserId]) -> Result<HashSet<UserId>> {
        if users.is_empty() {
            return Ok(HashSet::new());
        }
        let ids = serde_json::to_string(&users.iter().map(UserId::to_string).collect::<Vec<_>>())
            .expect("a list of strings is JSON");
        let rows = sqlx::query(
            "SELECT DISTINCT user_id FROM remote_followers \
             WHERE user_id IN (SELECT value FROM json_each(?1)) AND inbox IS NOT NULL",
        )
        .bind(ids)
        .fetch_all(&self.db.reads)
        .await?;
        Ok(rows.iter().filter_map(|row| UserId::parse("user_id", row.get::<&str, _>(0)).ok()).collect())
    }

    /// Queues `activity` for delivery: one `ActivityQueued` per inbox, once per activity id.
    /// Returns how many deliveries were queued and how many inboxes of unavailable servers were
    /// left out, or `None` when the activity was queued before.
    pub async fn queue_deliveries(
        &self,
        activity_id: String,
        sender: UserId,
        activity_json: String,
        audience: Audience,
        live_review: Option<ReviewId>,
    ) -> Result<Option<Queued>> {
        if matches!(audience, Audience::Followers) {
            // Most reviews are by users nobody elsewhere follows: answer those from a read, with
            // no write job (a follower arriving meanwhile is one arriving after the review).
            let any = sqlx::query("SELECT 1 FROM remote_followers WHERE user_id = ? AND inbox IS NOT NULL LIMIT 1")
                .bind(sender.to_string())
                .fetch_optional(&self.db.reads)
                .await?;
            if any.is_none() {
                // No follower, or no such user: the latter is NOT_FOUND, as with an inbox.
                return if self.user_exists(sender).await? {
                    Ok(Some(Queued::default()))
                } else {
                    Err(ServiceError::not_found(format_args!("user {sender}")).into())
                };
            }
        }
        let leave_out = self.servers.leaves_out();
        let probe_every = millis(self.servers.probe_every);
        write_job!(self, "queue_deliveries", |tx| {
            ensure_user(tx.conn(), sender).await?;
            // A review deleted since its Create or Update was raised (the handler behind, or the
            // event replayed) is not sent: its Delete may have gone already.
            if let Some(review) = live_review {
                let live = sqlx::query("SELECT 1 FROM reviews WHERE id = ? AND user_id = ?")
                    .bind(review.to_string())
                    .bind(sender.to_string())
                    .fetch_optional(tx.conn())
                    .await?;
                if live.is_none() {
                    return Ok(Some(Queued { review_gone: true, ..Queued::default() }));
                }
            }
            let first = sqlx::query(
                "INSERT OR IGNORE INTO federation_outbox (activity_id, queued, created_at) VALUES (?, 0, ?)",
            )
            .bind(activity_id.clone())
            .bind(tx.now_ms())
            .execute(tx.conn())
            .await?
            .rows_affected()
                > 0;
            if !first {
                return Ok(None);
            }
            let fan_out = matches!(audience, Audience::Followers);
            let inboxes: Vec<String> = match audience {
                Audience::Inbox(inbox) => vec![inbox],
                Audience::Followers => sqlx::query(
                    "SELECT DISTINCT COALESCE(shared_inbox, inbox) FROM remote_followers \
                     WHERE user_id = ? AND inbox IS NOT NULL ORDER BY 1",
                )
                .bind(sender.to_string())
                .fetch_all(tx.conn())
                .await?
                .into_iter()
                .map(|row| row.get(0))
                .collect(),
            };
            let mut events = Vec::with_capacity(inboxes.len());
            let mut skipped = 0;
            // Most instances have no failing server: one look then, none per inbox.
            let any_failing: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM federation_failing_hosts)")
                .fetch_one(tx.conn())
                .await?;
            let now = tx.now_ms();
            for inbox in inboxes {
                let server = server_of(&inbox);
                // (unavailable since, last probe queued) of a server with failures recorded.
                let failing: Option<(Option<i64>, Option<i64>)> = match &server {
                    Some(server) if any_failing => {
                        sqlx::query_as(
                            "SELECT unavailable_since, probed_at FROM federation_failing_hosts WHERE host = ?",
                        )
                        .bind(server.clone())
                        .fetch_optional(tx.conn())
                        .await?
                    }
                    _ => None,
                };
                let mut probe = false;
                if let (true, true, Some((Some(since), probed_at)), Some(server)) =
                    (fan_out, leave_out, failing, &server)
                {
                    // One delivery per probe interval goes, to find out whether it is back.
                    // (Probed only while unavailable: a probe is never older than `since`.)
                    if now - probed_at.unwrap_or(since) < probe_every {
                        skipped += 1;
                        continue;
                    }
                    sqlx::query("UPDATE federation_failing_hosts SET probed_at = ? WHERE host = ?")
                        .bind(now)
                        .bind(server.clone())
                        .execute(tx.conn())
                        .await?;
                    tracing::info!(server, activity = %activity_id, "an unavailable server is probed with one delivery");
                    probe = true;
                }
                events.push(NewEvent::new(
                    sender,
                    Payload::ActivityQueued(v1::ActivityQueued {
                        activity_id: activity_id.clone(),
                        inbox,
                        sender_user_id: sender.to_string(),
                        activity_json: activity_json.clone(),
                        inbox_failing: failing.is_some(),
                        probe,
                    }),
                ));
            }
            let queued = events.len() as u32;
            if skipped > 0 {
                tracing::info!(activity = %activity_id, skipped, "inboxes of unavailable servers left out");
            }
            sqlx::query("UPDATE federation_outbox SET queued = ? WHERE activity_id = ?")
                .bind(i64::from(queued))
                .bind(activity_id)
                .execute(tx.conn())
                .await?;
            commit_events(tx, events).await?;
            Ok(Some(Queued { queued, skipped_unavailable: skipped, review_gone: false }))
        })
        .await
    }

    /// Records what a delivery met at `inbox`'s server: an answer forgets its failures; a
    /// failure is counted, and may make the server unavailable (see [`FailingServer`]).
    /// Whether the server's record changed.
    pub async fn record_inbox_outcome(&self, inbox: String, answered: bool) -> Result<bool> {
        let server =
            server_of(&inbox).ok_or_else(|| ServiceError::invalid("inbox", format!("names no server: {inbox:?}")))?;
        let after = self.servers.unavailable_after;
        write_job!(self, "record_inbox_outcome", |tx| {
            if answered {
                return server_answered(tx.conn(), &server).await;
            }
            let now = tx.now_ms();
            let known: Option<FailingServer> = sqlx::query_as(
                "SELECT failing_since, last_failure_at, unavailable_since FROM federation_failing_hosts WHERE host = ?",
            )
            .bind(server.clone())
            .fetch_optional(tx.conn())
            .await?;
            let first = FailingServer { failing_since: now, last_failure_at: now, unavailable_since: None };
            let next = known.as_ref().unwrap_or(&first).failed_again(now, after);
            sqlx::query(
                "INSERT INTO federation_failing_hosts (host, failing_since, last_failure_at, failures, unavailable_since) \
                 VALUES (?1, ?2, ?3, 1, ?4) \
                 ON CONFLICT (host) DO UPDATE SET failing_since = ?2, last_failure_at = ?3, failures = failures + 1, \
                 unavailable_since = ?4",
            )
            .bind(server.clone())
            .bind(next.failing_since)
            .bind(next.last_failure_at)
            .bind(next.unavailable_since)
            .execute(tx.conn())
            .await?;
            if next.unavailable_since.is_some() && known.is_none_or(|k| k.unavailable_since.is_none()) {
                tracing::warn!(server, failing_since_ms = next.failing_since,
                    "a server failed every delivery for the unavailable-after time: fan-outs leave its inboxes out \
                     until it answers or sends an activity");
            }
            Ok(true)
        })
        .await
    }

    /// Removes `user`'s remote followers who receive at `inbox` (it answered 410 Gone).
    pub async fn remove_followers_at(&self, user: UserId, inbox: String) -> Result<bool> {
        write_job!(self, "remove_followers_at", |tx| {
            ensure_user(tx.conn(), user).await?;
            let removed = sqlx::query(
                "DELETE FROM remote_followers WHERE user_id = ?1 AND (inbox = ?2 OR shared_inbox = ?2) \
                 RETURNING actor_uri, activity_uri",
            )
            .bind(user.to_string())
            .bind(inbox)
            .fetch_all(tx.conn())
            .await?;
            let events = removed
                .iter()
                .map(|row| remote_follow_undone(row.get(0), &user.to_string(), row.get(1)))
                .collect::<Vec<_>>();
            commit_events(tx, events).await?;
            Ok(!removed.is_empty())
        })
        .await
    }

    /// A local user as an actor, by handle or id; `None` when there is no such user or it has
    /// no key yet.
    pub async fn local_actor(&self, handle: Option<&str>, user: Option<UserId>) -> Result<Option<LocalActorRow>> {
        let row = sqlx::query(
            "SELECT u.id, u.handle, u.display_name, u.created_at, k.public_key_pem, \
                    (SELECT COUNT(*) FROM remote_followers f WHERE f.user_id = u.id) \
                  + (SELECT COUNT(*) FROM follows l WHERE l.target = 'user:' || u.id), \
                    (SELECT COUNT(*) FROM reviews r WHERE r.user_id = u.id) \
             FROM users u JOIN actor_keys k ON k.user_id = u.id \
             WHERE (?1 IS NOT NULL AND u.handle = ?1) OR (?2 IS NOT NULL AND u.id = ?2)",
        )
        .bind(handle.map(str::to_owned))
        .bind(user.map(|u| u.to_string()))
        .fetch_optional(&self.db.reads)
        .await?;
        Ok(row.map(|row| LocalActorRow {
            user: UserRow { id: row.get(0), handle: row.get(1), display_name: row.get(2), created_at: row.get(3) },
            public_key_pem: row.get(4),
            followers: row.get::<i64, _>(5) as u64,
            reviews: row.get::<i64, _>(6) as u64,
        }))
    }

    /// A user's reviews with their movies, newest first; `after` is the last review id seen.
    pub async fn list_outbox(&self, user: UserId, limit: u32, after: Option<ReviewId>) -> Result<Vec<OutboxRow>> {
        let sql = if after.is_some() { OUTBOX_PAGE } else { OUTBOX_FIRST_PAGE };
        let rows = sqlx::query(sql)
            .bind(user.to_string())
            .bind(after.map(|id| id.to_string()))
            .bind(i64::from(limit))
            .fetch_all(&self.db.reads)
            .await?;
        let mut outbox = Vec::with_capacity(rows.len());
        for row in rows {
            outbox.push(OutboxRow {
                review: ReviewRow::from_row(&row)?,
                movie_title: row.get("title"),
                movie_year: row.get("year"),
                movie_external_id: row.get("external_id"),
            });
        }
        Ok(outbox)
    }
}

#[cfg(test)]
mod tests {
    use reelay_outbox::{Database, DbConfig};

    use crate::WriteError;

    use super::*;

    const HOUR: i64 = 3_600_000;

    /// An activity id is a repeat only from the actor that sent it first; one recorded before
    /// records had an actor (the table's rebuild) is a repeat from anyone, as it was.
    #[tokio::test]
    async fn an_activity_is_a_repeat_only_from_the_actor_that_sent_it() {
        let dir = tempfile::tempdir().unwrap();
        let config = DbConfig::new(dir.path().join("reelay.db"));
        let mut old = config.connect_and_migrate(Some(137)).await.unwrap();
        for sql in [
            "INSERT INTO federation_inbox (activity_id, received_at) VALUES ('https://peer.example/old', 5)",
            "INSERT INTO remote_review_tombstones (object_uri, actor_uri, deleted_at) \
             VALUES ('https://peer.example/users/a/statuses/1', 'https://peer.example/users/a', 5)",
        ] {
            sqlx::query(sql).execute(&mut old).await.unwrap();
        }
        drop(old);
        let db = Database::open(&config).await.unwrap();
        let (a, b) = ("https://peer.example/users/a", "https://peer.example/users/b");
        let id = |path: &str| Some(format!("https://peer.example/{path}"));
        let firsts = db
            .writer
            .transact::<_, WriteError, _>("test", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    let mut firsts = Vec::new();
                    for (actor, activity) in [(b, id("old")), (a, id("users/a#delete")), (b, id("users/a#delete"))] {
                        firsts.push(first_delivery(tx, actor, &activity).await?);
                    }
                    for (actor, activity) in [(a, id("users/a#delete")), (b, id("users/a#delete"))] {
                        firsts.push(first_delivery(tx, actor, &activity).await?);
                        firsts.push(!seen_before(tx, actor, &activity).await?);
                    }
                    Ok(firsts)
                })
            })
            .await
            .unwrap();
        assert_eq!(firsts, [false, true, true, false, false, false, false]);
        let tombstones: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT object_uri, actor_uri, deleted_at FROM remote_review_tombstones")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        assert_eq!(
            tombstones,
            [("https://peer.example/users/a/statuses/1".to_owned(), a.to_owned(), 5)],
            "kept through the rebuild"
        );
    }

    #[test]
    fn a_server_turns_unavailable_only_after_failing_without_a_long_gap() {
        let week = Some(Duration::from_secs(7 * 24 * 3600));
        let first = FailingServer { failing_since: 0, last_failure_at: 0, unavailable_since: None };
        // Failures every day for six days: still available.
        let mut s = first;
        for day in 1..=6 {
            s = s.failed_again(day * 24 * HOUR, week);
        }
        assert_eq!((s.failing_since, s.unavailable_since), (0, None));
        // A week after the first: unavailable, from then on.
        let s = s.failed_again(7 * 24 * HOUR, week);
        assert_eq!(s.unavailable_since, Some(7 * 24 * HOUR));
        let later = s.failed_again(40 * 24 * HOUR, week);
        assert_eq!((later.failing_since, later.unavailable_since), (0, Some(7 * 24 * HOUR)), "it stays so");

        // One failure, then nothing tried for more than a week: the next failure starts over.
        let once = FailingServer { failing_since: 0, last_failure_at: 0, unavailable_since: None };
        let again = once.failed_again(8 * 24 * HOUR, week);
        assert_eq!((again.failing_since, again.unavailable_since), (8 * 24 * HOUR, None));

        // Never unavailable when the setting is off.
        let off = FailingServer { failing_since: 0, last_failure_at: 0, unavailable_since: None };
        let off = off.failed_again(HOUR, None).failed_again(400 * 24 * HOUR, None);
        assert_eq!((off.failing_since, off.unavailable_since), (0, None));
    }
}
