//! Wrap-ups: requesting a user's wrap-up of a year, and reading it back.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{NewEvent, UserId, WrapUpId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;

use prost::Message;
use sqlx::Row;

use super::{MovieRow, Result, Store, WrapUpRow, commit_events, ensure_user, keyed_job, wrap_up_columns, write_job};
use crate::convert;
use crate::request_ids::RequestKey;

/// Raises the WrapUpRequested of wrap-up `id` and keeps its event id with the wrap-up.
async fn raise_request(tx: &mut WriteTx, id: &str, actor: UserId, year: i32) -> Result<()> {
    let event = NewEvent::new(
        id,
        Payload::WrapUpRequested(v1::WrapUpRequested { wrap_up_id: id.to_owned(), user_id: actor.to_string(), year }),
    );
    let event_id = commit_events(tx, vec![event]).await?[0].to_string();
    sqlx::query("UPDATE wrap_ups SET request_event_id = ? WHERE id = ?")
        .bind(event_id)
        .bind(id)
        .execute(tx.conn())
        .await?;
    Ok(())
}

/// Whether the delivery of wrap-up `id`'s latest request to the wrap-up handler was given up:
/// dead-lettered or discarded by the handler's ledger, or by the relay (nats). Each look is by
/// key; a wrap-up from before the request was kept is never asked again.
async fn request_given_up(tx: &mut WriteTx, id: &str) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM processed_events p JOIN wrap_ups w ON p.event_id = w.request_event_id \
             WHERE w.id = ?1 AND p.handler = 'wrap-up' AND p.status IN ('dead_lettered', 'discarded')) \
         OR EXISTS (SELECT 1 FROM event_queue q JOIN wrap_ups w ON q.event_id = w.request_event_id \
             WHERE w.id = ?1 AND q.status IN ('dead_lettered', 'discarded'))",
    )
    .bind(id)
    .fetch_one(tx.conn())
    .await?)
}

impl Store {
    /// Starts generating the actor's wrap-up of `year`, or returns the one that exists. One
    /// still generating whose request's delivery was given up (a dead letter the operator has
    /// not replayed yet, or discarded) is asked for again: a new WrapUpRequested resumes it.
    pub async fn request_wrap_up(
        &self,
        actor: UserId,
        year: i32,
        key: Option<RequestKey>,
    ) -> Result<v1::RequestWrapUpResponse> {
        keyed_job!(self, "request_wrap_up", key, |tx| {
            ensure_user(tx.conn(), actor).await?;
            let existing: Option<WrapUpRow> =
                sqlx::query_as(concat!("SELECT ", wrap_up_columns!(), " FROM wrap_ups WHERE user_id = ? AND year = ?"))
                    .bind(actor.to_string())
                    .bind(year)
                    .fetch_optional(tx.conn())
                    .await?;
            if let Some(wrap_up) = existing {
                if wrap_up.status == "generating" && request_given_up(tx, &wrap_up.id).await? {
                    tracing::warn!(wrap_up_id = %wrap_up.id, "the wrap-up's request was given up; asking again");
                    raise_request(tx, &wrap_up.id, actor, year).await?;
                }
                return Ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created: false });
            }
            let wrap_up = WrapUpRow {
                id: WrapUpId::new().to_string(),
                user_id: actor.to_string(),
                year: i64::from(year),
                status: "generating".into(),
                requested_at: tx.now_ms(),
                ..WrapUpRow::default()
            };
            sqlx::query("INSERT INTO wrap_ups (id, user_id, year, status, requested_at) VALUES (?, ?, ?, ?, ?)")
                .bind(wrap_up.id.clone())
                .bind(wrap_up.user_id.clone())
                .bind(wrap_up.year)
                .bind(wrap_up.status.clone())
                .bind(wrap_up.requested_at)
                .execute(tx.conn())
                .await?;
            raise_request(tx, &wrap_up.id, actor, year).await?;
            Ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created: true })
        })
        .await
    }

    pub async fn get_wrap_up(&self, id: WrapUpId) -> Result<WrapUpRow> {
        sqlx::query_as(concat!("SELECT ", wrap_up_columns!(), " FROM wrap_ups WHERE id = ?"))
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("wrap-up {id}")).into())
    }

    /// The diary entries of the wrap-up's user watched in its year, each with the day it was
    /// watched (the diary date, or the UTC day the entry was logged when it has none) and its film.
    pub async fn wrap_up_inputs(&self, id: WrapUpId) -> Result<(WrapUpRow, Vec<WrapUpEntryRow>)> {
        let wrap_up = self.get_wrap_up(id).await?;
        let rows = sqlx::query(concat!(
            "SELECT r.id, COALESCE(NULLIF(r.watched_on, ''), date(r.created_at / 1000, 'unixepoch')) AS day, ",
            "r.rating, r.rewatch, ",
            "m.id, m.title, m.year, m.external_id, m.created_at, m.enrichment, m.profile, m.enriched_at ",
            "FROM reviews r JOIN movies m ON m.id = r.movie_id WHERE r.user_id = ?1 AND substr(day, 1, 4) = ?2 ",
            "ORDER BY day, r.created_at"
        ))
        .bind(&wrap_up.user_id)
        .bind(format!("{:04}", wrap_up.year))
        .fetch_all(&self.db.reads)
        .await?;
        let entries = rows
            .into_iter()
            .map(|r| WrapUpEntryRow {
                review_id: r.get(0),
                watched_on: r.get(1),
                rating: r.get(2),
                rewatch: r.get(3),
                movie: MovieRow {
                    id: r.get(4),
                    title: r.get(5),
                    year: r.get(6),
                    external_id: r.get(7),
                    created_at: r.get(8),
                    enrichment: r.get(9),
                    profile: r.get(10),
                    enriched_at: r.get(11),
                },
            })
            .collect();
        Ok((wrap_up, entries))
    }

    /// Completes a `Generating` wrap-up with its figures and card, raising WrapUpCompleted; a
    /// wrap-up already completed is returned unchanged (and nothing is raised).
    pub async fn complete_wrap_up(&self, id: WrapUpId, completion: WrapUpCompletion) -> Result<(WrapUpRow, bool)> {
        write_job!(self, "complete_wrap_up", |tx| {
            let now = tx.now_ms();
            let completed = sqlx::query(
                "UPDATE wrap_ups SET status = 'completed', summary = ?, card_key = ?, card_content_type = ?, \
                 completed_at = ? WHERE id = ? AND status = 'generating'",
            )
            .bind(completion.summary.encode_to_vec())
            .bind(&completion.card_key)
            .bind(&completion.card_content_type)
            .bind(now)
            .bind(id.to_string())
            .execute(tx.conn())
            .await?
            .rows_affected()
                > 0;
            let wrap_up: WrapUpRow =
                sqlx::query_as(concat!("SELECT ", wrap_up_columns!(), " FROM wrap_ups WHERE id = ?"))
                    .bind(id.to_string())
                    .fetch_optional(tx.conn())
                    .await?
                    .ok_or_else(|| ServiceError::not_found(format_args!("wrap-up {id}")))?;
            if completed {
                let event = NewEvent::new(
                    &wrap_up.id,
                    Payload::WrapUpCompleted(v1::WrapUpCompleted {
                        wrap_up_id: wrap_up.id.clone(),
                        user_id: wrap_up.user_id.clone(),
                        year: wrap_up.year as i32,
                        card_key: completion.card_key,
                    }),
                );
                commit_events(tx, vec![event]).await?;
            }
            Ok((wrap_up, completed))
        })
        .await
    }
}

/// One diary entry of a wrap-up's year.
#[derive(Debug, Clone)]
pub struct WrapUpEntryRow {
    pub review_id: String,
    /// YYYY-MM-DD.
    pub watched_on: String,
    pub rating: i64,
    pub rewatch: bool,
    pub movie: MovieRow,
}

/// What completes a wrap-up.
#[derive(Debug, Clone)]
pub struct WrapUpCompletion {
    pub summary: v1::WrapUpSummary,
    pub card_key: String,
    pub card_content_type: String,
}

#[cfg(test)]
mod tests {
    use reelay_outbox::{Database, DbConfig};

    use super::*;

    async fn requests(db: &Database, wrap_up: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT event_id FROM event_queue WHERE aggregate_id = ? AND event_type = 'WrapUpRequested'")
            .bind(wrap_up)
            .fetch_all(&db.reads)
            .await
            .unwrap()
    }

    /// A wrap-up still generating whose request was given up is asked for again when the user
    /// asks again (once per request given up); one whose request is under way is not.
    #[tokio::test]
    async fn asking_again_resumes_a_wrap_up_whose_request_was_given_up() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        let store = Store::new(db.clone());
        let user = store.create_user("ana".into(), "Ana".into(), None).await.unwrap();
        let actor = UserId::parse("user_id", &user.user_id).unwrap();
        let first = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert!(first.created);
        let id = first.wrap_up.unwrap().wrap_up_id;
        let again = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert!(!again.created);
        let raised = requests(&db, &id).await;
        assert_eq!(raised.len(), 1, "under way: not asked again");

        let give_up = raised[0].clone();
        db.writer
            .transact::<_, crate::WriteError, _>("dead letter", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO processed_events (event_id, handler, status, started_at, attempts) \
                         VALUES (?, 'wrap-up', 'dead_lettered', 0, 8)",
                    )
                    .bind(give_up)
                    .execute(tx.conn())
                    .await?;
                    Ok(())
                })
            })
            .await
            .unwrap();
        let resumed = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert!(!resumed.created, "the same wrap-up");
        assert_eq!(resumed.wrap_up.unwrap().wrap_up_id, id);
        assert_eq!(requests(&db, &id).await.len(), 2, "asked again");
        store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert_eq!(requests(&db, &id).await.len(), 2, "the new request is under way");
    }
}
