//! Follows and blocks between a local user and another account, local or remote, and the
//! follower and following lists.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{NewEvent, UserId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;
use sqlx::{Row, SqliteConnection};

use super::{Result, Store, Target, commit_events, ensure_user, is_blocked, keyed_job, write_job};
use crate::WriteError;
use crate::request_ids::RequestKey;

/// Validates the other side of a social command: a local user must exist and not be the actor.
async fn check_target(conn: &mut SqliteConnection, actor: UserId, target: &Target) -> Result<()> {
    if let Target::User(id) = target {
        if *id == actor {
            return Err(ServiceError::invalid("target", "must be another account than actor_user_id").into());
        }
        ensure_user(conn, *id).await?;
    }
    Ok(())
}

/// Deletes `actor`'s follow of `target`; `Some` with the event id its Follow activity was named
/// after (empty for local targets) when there was one.
async fn delete_follow(conn: &mut SqliteConnection, actor: UserId, target: &Target) -> Result<Option<String>> {
    Ok(sqlx::query("DELETE FROM follows WHERE follower_id = ? AND target = ? RETURNING follow_event_id")
        .bind(actor.to_string())
        .bind(target.key())
        .fetch_optional(conn)
        .await?
        .map(|row| row.get::<Option<String>, _>(0).unwrap_or_default()))
}

/// A follow of a remote actor waiting for its Accept is sent again at most this often.
const FOLLOW_RESEND_AFTER_MS: i64 = 5_000;

/// `actor` followed the remote `target` again: when that follow still waits for its Accept and
/// its Follow was last sent over [`FOLLOW_RESEND_AFTER_MS`] ago, raises the `Followed` that sends
/// the same Follow again (its delivery may have been given up, and the user has no other way to
/// ask again short of unfollowing). True when it did.
async fn resend_follow(tx: &mut WriteTx, actor: UserId, target: &Target) -> Result<bool> {
    let waiting = sqlx::query(
        "SELECT follow_event_id, COALESCE(follow_sent_at, created_at) FROM follows \
         WHERE follower_id = ? AND target = ? AND accepted_at IS NULL",
    )
    .bind(actor.to_string())
    .bind(target.key())
    .fetch_optional(tx.conn())
    .await?;
    let Some(row) = waiting else { return Ok(false) };
    // A follow from before Follow activities were named after their event has no id to send
    // again (nor could its Accept be matched).
    let Some(follow_event_id) = row.get::<Option<String>, _>(0).filter(|id| !id.is_empty()) else {
        return Ok(false);
    };
    let now = tx.now_ms();
    if now - row.get::<i64, _>(1) < FOLLOW_RESEND_AFTER_MS {
        return Ok(false);
    }
    let payload = v1::Followed {
        follower_id: actor.to_string(),
        target: Some(target.to_proto()),
        resends_follow_event_id: follow_event_id,
    };
    commit_events(tx, vec![NewEvent::new(actor, Payload::Followed(payload))]).await?;
    sqlx::query("UPDATE follows SET follow_sent_at = ? WHERE follower_id = ? AND target = ?")
        .bind(now)
        .bind(actor.to_string())
        .bind(target.key())
        .execute(tx.conn())
        .await?;
    Ok(true)
}

impl Store {
    pub async fn follow(&self, actor: UserId, target: Target, key: Option<RequestKey>) -> Result<v1::SocialResponse> {
        keyed_job!(self, "follow", key, |tx| {
            ensure_user(tx.conn(), actor).await?;
            check_target(tx.conn(), actor, &target).await?;
            let actor_key = Target::User(actor).key();
            let blocked_by_target = match &target {
                Target::User(id) => is_blocked(tx.conn(), &id.to_string(), &actor_key).await?,
                Target::Actor(_) => false,
            };
            if blocked_by_target || is_blocked(tx.conn(), &actor.to_string(), &target.key()).await? {
                return Err(ServiceError::failed_precondition("target: a block exists between these accounts").into());
            }
            let inserted =
                sqlx::query("INSERT OR IGNORE INTO follows (follower_id, target, created_at) VALUES (?, ?, ?)")
                    .bind(actor.to_string())
                    .bind(target.key())
                    .bind(tx.now_ms())
                    .execute(tx.conn())
                    .await?
                    .rows_affected()
                    > 0;
            if !inserted {
                if let Target::Actor(_) = &target {
                    resend_follow(tx, actor, &target).await?;
                }
            } else {
                let event = NewEvent::new(
                    actor,
                    Payload::Followed(v1::Followed {
                        follower_id: actor.to_string(),
                        target: Some(target.to_proto()),
                        resends_follow_event_id: String::new(),
                    }),
                );
                let ids = commit_events(tx, vec![event]).await?;
                if let (Target::Actor(_), Some(event_id)) = (&target, ids.first()) {
                    // The Follow activity sent for it is named after this event; its Accept and
                    // Undo name it back.
                    sqlx::query("UPDATE follows SET follow_event_id = ? WHERE follower_id = ? AND target = ?")
                        .bind(event_id.to_string())
                        .bind(actor.to_string())
                        .bind(target.key())
                        .execute(tx.conn())
                        .await?;
                }
            }
            Ok(v1::SocialResponse { changed: inserted })
        })
        .await
    }

    pub async fn unfollow(&self, actor: UserId, target: Target) -> Result<bool> {
        write_job!(self, "unfollow", |tx| {
            ensure_user(tx.conn(), actor).await?;
            let Some(follow_event_id) = delete_follow(tx.conn(), actor, &target).await? else { return Ok(false) };
            let payload = v1::Unfollowed {
                follower_id: actor.to_string(),
                target: Some(target.to_proto()),
                follow_event_id,
                rejected: false,
            };
            commit_events(tx, vec![NewEvent::new(actor, Payload::Unfollowed(payload))]).await?;
            Ok(true)
        })
        .await
    }

    /// Deletes the row `sql` names by (`first`, `second`) after checking that `owner` exists,
    /// and raises `event` when there was a row: unblock, watchlist removal.
    pub(super) async fn remove_pair(
        &self,
        job: &'static str,
        sql: &'static str,
        owner: UserId,
        (first, second): (String, String),
        event: impl FnOnce() -> NewEvent + Send + 'static,
    ) -> Result<bool> {
        self.db
            .writer
            .transact::<_, WriteError, _>(job, move |tx: &mut WriteTx| {
                Box::pin(async move {
                    ensure_user(tx.conn(), owner).await?;
                    let removed =
                        sqlx::query(sql).bind(first).bind(second).execute(tx.conn()).await?.rows_affected() > 0;
                    if removed {
                        commit_events(tx, vec![event()]).await?;
                    }
                    Ok(removed)
                })
            })
            .await
    }

    /// Blocks an account and severs follows in both directions, in one transaction.
    pub async fn block(&self, actor: UserId, target: Target, key: Option<RequestKey>) -> Result<v1::SocialResponse> {
        keyed_job!(self, "block", key, |tx| {
            ensure_user(tx.conn(), actor).await?;
            check_target(tx.conn(), actor, &target).await?;
            let inserted =
                sqlx::query("INSERT OR IGNORE INTO blocks (blocker_id, target, created_at) VALUES (?, ?, ?)")
                    .bind(actor.to_string())
                    .bind(target.key())
                    .bind(tx.now_ms())
                    .execute(tx.conn())
                    .await?
                    .rows_affected()
                    > 0;
            if !inserted {
                return Ok(v1::SocialResponse { changed: false });
            }
            let mut blocked =
                v1::Blocked { blocker_id: actor.to_string(), target: Some(target.to_proto()), ..Default::default() };
            let mut events = Vec::new();
            if let Some(follow_event_id) = delete_follow(tx.conn(), actor, &target).await? {
                events.push(NewEvent::new(
                    actor,
                    Payload::Unfollowed(v1::Unfollowed {
                        follower_id: actor.to_string(),
                        target: Some(target.to_proto()),
                        follow_event_id,
                        rejected: false,
                    }),
                ));
            }
            match &target {
                Target::User(id) => {
                    let incoming = sqlx::query("DELETE FROM follows WHERE follower_id = ? AND target = ?")
                        .bind(id.to_string())
                        .bind(Target::User(actor).key())
                        .execute(tx.conn())
                        .await?
                        .rows_affected();
                    if incoming > 0 {
                        events.push(NewEvent::new(
                            *id,
                            Payload::Unfollowed(v1::Unfollowed {
                                follower_id: id.to_string(),
                                target: Some(Target::User(actor).to_proto()),
                                follow_event_id: String::new(),
                                rejected: false,
                            }),
                        ));
                    }
                }
                Target::Actor(uri) => {
                    // A follow of the blocker ends, and the Blocked event names it: the
                    // federation handler sends its server a Reject of it (else that server would
                    // go on counting it a follower, and showing it what it is sent).
                    let removed: Option<(String, Option<String>)> = sqlx::query_as(
                        "DELETE FROM remote_followers WHERE user_id = ? AND actor_uri = ? RETURNING activity_uri, inbox",
                    )
                    .bind(actor.to_string())
                    .bind(uri.clone())
                    .fetch_optional(tx.conn())
                    .await?;
                    if let Some((follow, inbox)) = removed {
                        blocked.removed_follow_uri = follow;
                        blocked.removed_follower_inbox = inbox.unwrap_or_default();
                    }
                }
            }
            events.insert(0, NewEvent::new(actor, Payload::Blocked(blocked)));
            commit_events(tx, events).await?;
            Ok(v1::SocialResponse { changed: true })
        })
        .await
    }

    pub async fn unblock(&self, actor: UserId, target: Target) -> Result<bool> {
        let sql = "DELETE FROM blocks WHERE blocker_id = ? AND target = ?";
        let key = (actor.to_string(), target.key());
        self.remove_pair("unblock", sql, actor, key, move || {
            let payload = v1::Unblocked { blocker_id: actor.to_string(), target: Some(target.to_proto()) };
            NewEvent::new(actor, Payload::Unblocked(payload))
        })
        .await
    }

    /// Local and remote followers as account keys, ordered by key; `after` is the last key seen.
    pub async fn list_followers(&self, user: UserId, limit: u32, after: &str) -> Result<Vec<String>> {
        let keys = sqlx::query(
            "SELECT k FROM (SELECT 'user:' || follower_id AS k FROM follows WHERE target = ?1 \
                            UNION ALL SELECT 'actor:' || actor_uri FROM remote_followers WHERE user_id = ?2) \
             WHERE k > ?3 ORDER BY k LIMIT ?4",
        )
        .bind(Target::User(user).key())
        .bind(user.to_string())
        .bind(after.to_owned())
        .bind(i64::from(limit))
        .fetch_all(&self.db.reads)
        .await?;
        Ok(keys.into_iter().map(|r| r.get(0)).collect())
    }

    pub async fn list_following(&self, user: UserId, limit: u32, after: &str) -> Result<Vec<String>> {
        let keys =
            sqlx::query("SELECT target FROM follows WHERE follower_id = ?1 AND target > ?2 ORDER BY target LIMIT ?3")
                .bind(user.to_string())
                .bind(after.to_owned())
                .bind(i64::from(limit))
                .fetch_all(&self.db.reads)
                .await?;
        Ok(keys.into_iter().map(|r| r.get(0)).collect())
    }
}
