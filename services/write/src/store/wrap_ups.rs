//! Wrap-ups: requesting a user's wrap-up of a year, and reading it back.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{NewEvent, UserId, WrapUpId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;

use super::{Result, Store, WrapUpRow, commit_events, ensure_user, keyed_job};
use crate::convert;
use crate::request_ids::RequestKey;

impl Store {
    /// Starts generating the actor's wrap-up of `year`, or returns the one that exists.
    pub async fn request_wrap_up(
        &self,
        actor: UserId,
        year: i32,
        key: Option<RequestKey>,
    ) -> Result<v1::RequestWrapUpResponse> {
        keyed_job!(self, "request_wrap_up", key, |tx| {
            ensure_user(tx.conn(), actor).await?;
            let existing: Option<WrapUpRow> = sqlx::query_as(
                "SELECT id, user_id, year, status, summary_json, requested_at, completed_at FROM wrap_ups WHERE user_id = ? AND year = ?",
            )
            .bind(actor.to_string())
            .bind(year)
            .fetch_optional(tx.conn())
            .await?;
            if let Some(wrap_up) = existing {
                return Ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created: false });
            }
            let wrap_up = WrapUpRow {
                id: WrapUpId::new().to_string(),
                user_id: actor.to_string(),
                year: i64::from(year),
                status: "generating".into(),
                summary_json: String::new(),
                requested_at: tx.now_ms(),
                completed_at: None,
            };
            sqlx::query("INSERT INTO wrap_ups (id, user_id, year, status, requested_at) VALUES (?, ?, ?, ?, ?)")
                .bind(wrap_up.id.clone())
                .bind(wrap_up.user_id.clone())
                .bind(wrap_up.year)
                .bind(wrap_up.status.clone())
                .bind(wrap_up.requested_at)
                .execute(tx.conn())
                .await?;
            let event = NewEvent::new(
                &wrap_up.id,
                Payload::WrapUpRequested(v1::WrapUpRequested { wrap_up_id: wrap_up.id.clone(), user_id: actor.to_string(), year }),
            );
            commit_events(tx, vec![event]).await?;
            Ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created: true })
        })
        .await
    }

    pub async fn get_wrap_up(&self, id: WrapUpId) -> Result<WrapUpRow> {
        sqlx::query_as(
            "SELECT id, user_id, year, status, summary_json, requested_at, completed_at FROM wrap_ups WHERE id = ?",
        )
        .bind(id.to_string())
        .fetch_optional(&self.db.reads)
        .await?
        .ok_or_else(|| ServiceError::not_found(format_args!("wrap-up {id}")).into())
    }
}
