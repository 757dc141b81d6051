//! Wrap-ups: requesting a user's wrap-up of a year, and reading it back.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{NewEvent, UserId, WrapUpId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;

use prost::Message;
use sqlx::Row;

use super::{
    MovieRow, Result, ReviewRow, Store, WrapUpRow, commit_events, ensure_user, keyed_job, wrap_up_columns, write_job,
};
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
            let existing: Option<WrapUpRow> =
                sqlx::query_as(concat!("SELECT ", wrap_up_columns!(), " FROM wrap_ups WHERE user_id = ? AND year = ?"))
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
            let event = NewEvent::new(
                &wrap_up.id,
                Payload::WrapUpRequested(v1::WrapUpRequested {
                    wrap_up_id: wrap_up.id.clone(),
                    user_id: actor.to_string(),
                    year,
                }),
            );
            commit_events(tx, vec![event]).await?;
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

    /// The diary entries of the wrap-up's user watched in its year (the diary date, or the day
    /// the entry was logged when it has none), each with its film.
    pub async fn wrap_up_inputs(&self, id: WrapUpId) -> Result<(WrapUpRow, Vec<(ReviewRow, MovieRow)>)> {
        let wrap_up = self.get_wrap_up(id).await?;
        let (from_ms, to_ms) = year_bounds_ms(wrap_up.year as i32);
        let rows = sqlx::query(concat!(
            "SELECT r.id, r.user_id, r.movie_id, r.rating, r.body, r.watched_on, r.rewatch, r.source, r.created_at, r.updated_at, ",
            "m.id, m.title, m.year, m.external_id, m.created_at, m.enrichment, m.profile, m.enriched_at ",
            "FROM reviews r JOIN movies m ON m.id = r.movie_id WHERE r.user_id = ?1 AND ",
            "((r.watched_on != '' AND substr(r.watched_on, 1, 4) = ?2) OR (r.watched_on = '' AND r.created_at >= ?3 AND r.created_at < ?4)) ",
            "ORDER BY r.watched_on, r.created_at"
        ))
        .bind(&wrap_up.user_id)
        .bind(format!("{:04}", wrap_up.year))
        .bind(from_ms)
        .bind(to_ms)
        .fetch_all(&self.db.reads)
        .await?;
        let entries = rows
            .into_iter()
            .map(|r| {
                let review = ReviewRow {
                    id: r.get(0),
                    user_id: r.get(1),
                    movie_id: r.get(2),
                    rating: r.get(3),
                    body: r.get(4),
                    watched_on: r.get(5),
                    rewatch: r.get(6),
                    source: r.get(7),
                    created_at: r.get(8),
                    updated_at: r.get(9),
                };
                let movie = MovieRow {
                    id: r.get(10),
                    title: r.get(11),
                    year: r.get(12),
                    external_id: r.get(13),
                    created_at: r.get(14),
                    enrichment: r.get(15),
                    profile: r.get(16),
                    enriched_at: r.get(17),
                };
                (review, movie)
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
                "UPDATE wrap_ups SET status = 'completed', summary = ?, summary_json = ?, card_key = ?, \
                 card_content_type = ?, completed_at = ? WHERE id = ? AND status = 'generating'",
            )
            .bind(completion.summary.encode_to_vec())
            .bind(completion.summary_json)
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

/// What completes a wrap-up.
#[derive(Debug, Clone)]
pub struct WrapUpCompletion {
    pub summary: v1::WrapUpSummary,
    pub summary_json: String,
    pub card_key: String,
    pub card_content_type: String,
}

/// The first millisecond of `year` and of the year after, UTC.
fn year_bounds_ms(year: i32) -> (i64, i64) {
    let days_from_civil = |y: i64| {
        // Days from 1970-01-01 to y-01-01 (proleptic Gregorian).
        let y1 = y - 1;
        365 * (y - 1970) + (y1 / 4 - 1969 / 4) - (y1 / 100 - 1969 / 100) + (y1 / 400 - 1969 / 400)
    };
    let day = 86_400_000;
    (days_from_civil(i64::from(year)) * day, days_from_civil(i64::from(year) + 1) * day)
}

#[cfg(test)]
mod tests {
    #[test]
    fn year_bounds() {
        assert_eq!(super::year_bounds_ms(1970), (0, 365 * 86_400_000));
        // 2024-01-01T00:00:00Z and 2025-01-01T00:00:00Z.
        assert_eq!(super::year_bounds_ms(2024), (1_704_067_200_000, 1_735_689_600_000));
    }
}
