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

/// The statement of `year_entries`, with `$profile` as the profile's column.
macro_rules! year_entries_sql {
    ($profile:literal) => {
        concat!(
            "SELECT r.id, COALESCE(NULLIF(r.watched_on, ''), date(r.created_at / 1000, 'unixepoch')) AS day, ",
            "r.rating, r.rewatch, ",
            "m.id, m.title, m.year, m.external_id, m.created_at, m.enrichment, ",
            $profile,
            ", m.enriched_at ",
            "FROM reviews r JOIN movies m ON m.id = r.movie_id WHERE r.user_id = ?1 AND substr(day, 1, 4) = ?2 ",
            "ORDER BY day, r.created_at, r.id"
        )
    };
}

/// The diary entries of `user` watched in `year`, in the order watched, each with its film;
/// the films' profiles only `with_profiles` (the digest does not read them).
async fn year_entries(
    conn: &mut sqlx::SqliteConnection,
    user: &str,
    year: i32,
    with_profiles: bool,
) -> Result<Vec<WrapUpEntryRow>> {
    let sql = if with_profiles { year_entries_sql!("m.profile") } else { year_entries_sql!("NULL") };
    let rows = sqlx::query(sql).bind(user).bind(format!("{year:04}")).fetch_all(conn).await?;
    Ok(rows
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
        .collect())
}

/// What a year's figures are computed from, as 64 hex digits: each entry's review, day,
/// rating and rewatch, and its film's identity and enrichment (a new profile is saved with a new
/// `enriched_at`). A review's text is not in it: editing only that changes no figure.
fn inputs_digest(entries: &[WrapUpEntryRow]) -> String {
    let mut fields: Vec<String> = Vec::with_capacity(entries.len() * 9);
    for e in entries {
        let m = &e.movie;
        fields.extend([
            e.review_id.clone(),
            e.watched_on.clone(),
            e.rating.to_string(),
            u8::from(e.rewatch).to_string(),
            m.id.clone(),
            m.title.clone(),
            m.year.to_string(),
            m.enrichment.clone(),
            m.enriched_at.map(|t| t.to_string()).unwrap_or_default(),
        ]);
    }
    crate::request_ids::sha256_of_parts(b"wrap-up inputs", fields.iter().map(String::as_bytes))
}

impl Store {
    /// Starts generating the actor's wrap-up of `year`, or returns the newest one. One still
    /// generating whose request's delivery was given up (a dead letter the operator has not
    /// replayed yet, or discarded) is asked for again: a new WrapUpRequested resumes it. One
    /// completed from inputs the year's diary no longer matches is replaced by a new wrap-up.
    pub async fn request_wrap_up(
        &self,
        actor: UserId,
        year: i32,
        key: Option<RequestKey>,
    ) -> Result<v1::RequestWrapUpResponse> {
        // The year's diary is read here, on a read connection, when the newest wrap-up is
        // completed (the common ask: a wrap-up opened again): read in the write job, a year of
        // a large diary held every other write back (a second at 200,000 reviews). A review
        // logged between this read and the job is as if logged just after the call.
        let read_digest = match self.newest_wrap_up_status(actor, year).await?.as_deref() {
            Some("completed") => {
                let _one_at_a_time = self.year_reads.acquire().await.expect("the semaphore is never closed");
                let mut conn = self.db.reads.acquire().await?;
                Some(inputs_digest(&year_entries(&mut conn, &actor.to_string(), year, false).await?))
            }
            _ => None,
        };
        keyed_job!(self, "request_wrap_up", key, |tx| {
            ensure_user(tx.conn(), actor).await?;
            let newest: Option<WrapUpRow> = sqlx::query_as(concat!(
                "SELECT ",
                wrap_up_columns!(),
                " FROM wrap_ups WHERE user_id = ? AND year = ? ORDER BY rowid DESC LIMIT 1"
            ))
            .bind(actor.to_string())
            .bind(year)
            .fetch_optional(tx.conn())
            .await?;
            let mut previous_id = None;
            if let Some(wrap_up) = newest {
                if wrap_up.status == "generating" {
                    if request_given_up(tx, &wrap_up.id).await? {
                        tracing::warn!(wrap_up_id = %wrap_up.id, "the wrap-up's request was given up; asking again");
                        raise_request(tx, &wrap_up.id, actor, year).await?;
                    }
                    return Ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created: false });
                }
                // Completed since the read above (rare): read the diary here.
                let current = match &read_digest {
                    Some(digest) => digest.clone(),
                    None => inputs_digest(&year_entries(tx.conn(), &wrap_up.user_id, year, false).await?),
                };
                if wrap_up.inputs_digest.as_deref() == Some(current.as_str()) {
                    return Ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created: false });
                }
                tracing::info!(wrap_up_id = %wrap_up.id, year,
                    "the year's diary changed since the wrap-up was computed; making it again");
                previous_id = Some(wrap_up.id);
            }
            let wrap_up = WrapUpRow {
                id: WrapUpId::new().to_string(),
                user_id: actor.to_string(),
                year: i64::from(year),
                status: "generating".into(),
                requested_at: tx.now_ms(),
                previous_id,
                ..WrapUpRow::default()
            };
            sqlx::query(
                "INSERT INTO wrap_ups (id, user_id, year, status, requested_at, previous_id) VALUES (?, ?, ?, ?, ?, ?)",
            )
            .bind(wrap_up.id.clone())
            .bind(wrap_up.user_id.clone())
            .bind(wrap_up.year)
            .bind(wrap_up.status.clone())
            .bind(wrap_up.requested_at)
            .bind(wrap_up.previous_id.clone())
            .execute(tx.conn())
            .await?;
            raise_request(tx, &wrap_up.id, actor, year).await?;
            Ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created: true })
        })
        .await
    }

    /// The status of the actor's newest wrap-up of `year`, read outside the writer.
    async fn newest_wrap_up_status(&self, actor: UserId, year: i32) -> Result<Option<String>> {
        Ok(sqlx::query_scalar("SELECT status FROM wrap_ups WHERE user_id = ? AND year = ? ORDER BY rowid DESC LIMIT 1")
            .bind(actor.to_string())
            .bind(year)
            .fetch_optional(&self.db.reads)
            .await?)
    }

    pub async fn get_wrap_up(&self, id: WrapUpId) -> Result<WrapUpRow> {
        sqlx::query_as(concat!("SELECT ", wrap_up_columns!(), " FROM wrap_ups WHERE id = ?"))
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("wrap-up {id}")).into())
    }

    /// The diary entries of the wrap-up's user watched in its year, each with the day it was
    /// watched (the diary date, or the UTC day the entry was logged when it has none) and its
    /// film, and their digest.
    pub async fn wrap_up_inputs(&self, id: WrapUpId) -> Result<(WrapUpRow, Vec<WrapUpEntryRow>, String)> {
        let wrap_up = self.get_wrap_up(id).await?;
        let mut conn = self.db.reads.acquire().await?;
        let entries = year_entries(&mut conn, &wrap_up.user_id, wrap_up.year as i32, true).await?;
        let digest = inputs_digest(&entries);
        Ok((wrap_up, entries, digest))
    }

    /// Completes a `Generating` wrap-up with its figures and card, raising WrapUpCompleted; a
    /// wrap-up already completed is returned unchanged (and nothing is raised).
    pub async fn complete_wrap_up(&self, id: WrapUpId, completion: WrapUpCompletion) -> Result<(WrapUpRow, bool)> {
        write_job!(self, "complete_wrap_up", |tx| {
            let now = tx.now_ms();
            let completed = sqlx::query(
                "UPDATE wrap_ups SET status = 'completed', summary = ?, card_key = ?, card_content_type = ?, \
                 inputs_digest = ?, completed_at = ? WHERE id = ? AND status = 'generating'",
            )
            .bind(completion.summary.encode_to_vec())
            .bind(&completion.card_key)
            .bind(&completion.card_content_type)
            .bind(completion.inputs_digest)
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
    /// The digest of the inputs the figures were computed from, if the handler gave it.
    pub inputs_digest: Option<String>,
}

#[cfg(test)]
mod tests {
    use reelay_domain::{MovieId, ReviewId};
    use reelay_outbox::{Database, DbConfig};

    use super::*;
    use crate::store::{Enrichment, MovieSpec, ReviewFields};

    async fn requests(db: &Database, wrap_up: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT event_id FROM event_queue WHERE aggregate_id = ? AND event_type = 'WrapUpRequested'")
            .bind(wrap_up)
            .fetch_all(&db.reads)
            .await
            .unwrap()
    }

    /// Runs `sql` with `value` bound, in a write job of its own.
    async fn execute(db: &Database, sql: &'static str, value: &str) {
        let value = value.to_owned();
        db.writer
            .transact::<_, crate::WriteError, _>("test statement", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    sqlx::query(sql).bind(value).execute(tx.conn()).await?;
                    Ok(())
                })
            })
            .await
            .unwrap();
    }

    /// Completes wrap-up `id` from the inputs GetWrapUpInputs gives now; returns their digest.
    async fn complete(store: &Store, id: &str, digest: Option<String>) -> String {
        let id = WrapUpId::parse("wrap_up_id", id).unwrap();
        let (_, _, now) = store.wrap_up_inputs(id).await.unwrap();
        let completion = WrapUpCompletion {
            summary: v1::WrapUpSummary { per_month: vec![0; 12], ..Default::default() },
            card_key: format!("wrapups/{id}/card.svg"),
            card_content_type: "image/svg+xml".into(),
            inputs_digest: digest.clone().or(Some(now.clone())),
        };
        assert!(store.complete_wrap_up(id, completion).await.unwrap().1);
        now
    }

    /// Asking again for a completed wrap-up returns it while the year's diary is what its figures
    /// came from, and makes a new one (naming the old) once the diary changed in what the
    /// figures use: an entry logged, edited, deleted, its film enriched. Entries of other years,
    /// and a review's text, change nothing; a wrap-up completed without a digest (a handler from
    /// before it), or from inputs read before a change, is made again.
    #[tokio::test]
    async fn asking_again_makes_a_new_wrap_up_once_the_diary_changed() {
        let (_dir, db, store, actor) = super::super::store_with_ana().await;
        let fields = |rating: u32, watched_on: &str, body: &str| ReviewFields {
            rating,
            body: body.into(),
            watched_on: watched_on.into(),
            rewatch: false,
        };
        let heat = MovieSpec::TitleYear {
            title: "Heat".into(),
            year: 1995,
            external_id: None,
            external_id_field: String::new(),
        };
        let logged = store.log_review(actor, heat, fields(8, "2024-03-01", "tense"), None).await.unwrap();
        let review = ReviewId::parse("review_id", &logged.review.unwrap().review_id).unwrap();
        let movie = MovieId::parse("movie_id", &store.get_review(review).await.unwrap().movie_id).unwrap();
        let ask = || store.request_wrap_up(actor, 2024, None);

        let first = ask().await.unwrap();
        assert!(first.created);
        let first = first.wrap_up.unwrap().wrap_up_id;
        complete(&store, &first, None).await;
        let unchanged = ask().await.unwrap();
        assert!(!unchanged.created, "the diary is what the figures came from");
        assert_eq!(unchanged.wrap_up.unwrap().wrap_up_id, first);

        // Nothing the figures use: another year's entry, the text of this one.
        let other = MovieSpec::Id(movie);
        store.log_review(actor, other, fields(6, "2023-12-31", ""), None).await.unwrap();
        store.edit_review(actor, review, fields(8, "2024-03-01", "tense, long"), None).await.unwrap();
        let still = ask().await.unwrap();
        assert!(!still.created, "no figure could have changed");
        assert_eq!(still.wrap_up.as_ref().unwrap().wrap_up_id, first);
        assert_eq!(requests(&db, &first).await.len(), 1);

        // Each change the figures use makes the next ask a new wrap-up.
        let mut newest = first.clone();
        let changes =
            ["a rating edited", "an entry logged", "the film enriched", "its profile replaced", "an entry deleted"];
        for change in changes {
            match change {
                "a rating edited" => {
                    store.edit_review(actor, review, fields(10, "2024-03-01", "tense"), None).await.unwrap();
                }
                "an entry logged" => {
                    store.log_review(actor, MovieSpec::Id(movie), fields(9, "2024-11-02", ""), None).await.unwrap();
                }
                "the film enriched" | "its profile replaced" => {
                    // A profile is told apart by the millisecond it was saved in.
                    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                    let runtime_minutes = if change == "the film enriched" { 170 } else { 171 };
                    let profile = v1::MovieProfile { runtime_minutes, ..Default::default() };
                    store.save_enrichment(movie, Enrichment::Profile(profile), None).await.unwrap();
                }
                _ => {
                    store.delete_review(actor, review, None).await.unwrap();
                }
            }
            let again = ask().await.unwrap();
            assert!(again.created, "{change}: a new wrap-up");
            let again = again.wrap_up.unwrap();
            assert_eq!(again.previous_wrap_up_id, newest, "{change}: it names the one it replaces");
            assert_eq!(again.status(), v1::WrapUpStatus::Generating);
            let generating = ask().await.unwrap();
            assert!(!generating.created, "{change}: one at a time");
            assert_eq!(generating.wrap_up.unwrap().wrap_up_id, again.wrap_up_id);
            assert_eq!(requests(&db, &again.wrap_up_id).await.len(), 1, "{change}: requested once");
            complete(&store, &again.wrap_up_id, None).await;
            assert!(!ask().await.unwrap().created, "{change}: then it stands");
            newest = again.wrap_up_id;
        }
        let old = store.get_wrap_up(WrapUpId::parse("wrap_up_id", &first).unwrap()).await.unwrap();
        assert_eq!((old.status.as_str(), old.previous_id), ("completed", None), "the first stays readable");

        // Completed without a digest, or from inputs read before a change: made again.
        let stale = store.wrap_up_inputs(WrapUpId::parse("wrap_up_id", &newest).unwrap()).await.unwrap().2;
        store.log_review(actor, MovieSpec::Id(movie), fields(4, "2024-12-30", ""), None).await.unwrap();
        let after_change = ask().await.unwrap().wrap_up.unwrap().wrap_up_id;
        complete(&store, &after_change, Some(stale)).await;
        let again = ask().await.unwrap();
        assert!(again.created, "computed from inputs read before the change");
        let again = again.wrap_up.unwrap().wrap_up_id;
        let completion = WrapUpCompletion {
            summary: v1::WrapUpSummary { per_month: vec![0; 12], ..Default::default() },
            card_key: "wrapups/x/card.svg".into(),
            card_content_type: "image/svg+xml".into(),
            inputs_digest: None,
        };
        store.complete_wrap_up(WrapUpId::parse("wrap_up_id", &again).unwrap(), completion).await.unwrap();
        assert!(ask().await.unwrap().created, "completed without a digest");
    }

    /// The newest wrap-up of a year is the last one made, even when the clock stepped back
    /// after an older one was asked for.
    #[tokio::test]
    async fn the_newest_wrap_up_is_the_last_made_whatever_the_clock_said() {
        let (_dir, db, store, actor) = super::super::store_with_ana().await;
        let first = store.request_wrap_up(actor, 2024, None).await.unwrap().wrap_up.unwrap().wrap_up_id;
        complete(&store, &first, None).await;
        // Asked for an hour ahead of the clock that follows.
        execute(&db, "UPDATE wrap_ups SET requested_at = requested_at + 3600000 WHERE id = ?", &first).await;
        let fields = ReviewFields { rating: 7, body: String::new(), watched_on: "2024-05-05".into(), rewatch: false };
        let heat = MovieSpec::TitleYear {
            title: "Heat".into(),
            year: 1995,
            external_id: None,
            external_id_field: String::new(),
        };
        store.log_review(actor, heat, fields, None).await.unwrap();
        let second = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert!(second.created);
        let second = second.wrap_up.unwrap().wrap_up_id;
        let again = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert_eq!((again.created, again.wrap_up.unwrap().wrap_up_id), (false, second.clone()), "still generating");
        complete(&store, &second, None).await;
        let done = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert_eq!((done.created, done.wrap_up.unwrap().wrap_up_id), (false, second), "and then it stands");
    }

    /// Wrap-ups written before a year's wrap-up could be made again keep every column through
    /// the table's rebuild; their digest is unknown, so the next ask makes the year's again.
    #[tokio::test]
    async fn wrap_ups_from_before_the_upgrade_are_kept_and_made_again() {
        let dir = tempfile::tempdir().unwrap();
        let config = DbConfig::new(dir.path().join("reelay.db"));
        let mut old = config.connect_and_migrate(Some(130)).await.unwrap();
        let (user, id) = (UserId::new(), WrapUpId::new());
        sqlx::query("INSERT INTO users (id, handle, display_name, created_at) VALUES (?, 'ana', 'Ana', 1)")
            .bind(user.to_string())
            .execute(&mut old)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO wrap_ups (id, user_id, year, status, requested_at, completed_at, summary, card_key, \
             card_content_type, request_event_id) VALUES (?, ?, 2024, 'completed', 10, 20, x'0801', 'k', 't', 'e1')",
        )
        .bind(id.to_string())
        .bind(user.to_string())
        .execute(&mut old)
        .await
        .unwrap();
        drop(old);

        let db = Database::open(&config).await.unwrap();
        let store = Store::new(db.clone());
        let kept = store.get_wrap_up(id).await.unwrap();
        let expected = WrapUpRow {
            id: id.to_string(),
            user_id: user.to_string(),
            year: 2024,
            status: "completed".into(),
            requested_at: 10,
            completed_at: Some(20),
            summary: Some(vec![8, 1]),
            card_key: Some("k".into()),
            card_content_type: Some("t".into()),
            inputs_digest: None,
            previous_id: None,
        };
        assert_eq!(kept, expected);
        let event: Option<String> = sqlx::query_scalar("SELECT request_event_id FROM wrap_ups WHERE id = ?")
            .bind(id.to_string())
            .fetch_one(&db.reads)
            .await
            .unwrap();
        assert_eq!(event.as_deref(), Some("e1"));
        let again = store.request_wrap_up(user, 2024, None).await.unwrap();
        assert!(again.created);
        assert_eq!(again.wrap_up.unwrap().previous_wrap_up_id, id.to_string());
    }

    /// A wrap-up still generating whose request was given up is asked for again when the user
    /// asks again (once per request given up); one whose request is under way is not.
    #[tokio::test]
    async fn asking_again_resumes_a_wrap_up_whose_request_was_given_up() {
        let (_dir, db, store, actor) = super::super::store_with_ana().await;
        let first = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert!(first.created);
        let id = first.wrap_up.unwrap().wrap_up_id;
        let again = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert!(!again.created);
        let raised = requests(&db, &id).await;
        assert_eq!(raised.len(), 1, "under way: not asked again");

        let dead_letter = "INSERT INTO processed_events (event_id, handler, status, started_at, attempts) \
                           VALUES (?, 'wrap-up', 'dead_lettered', 0, 8)";
        execute(&db, dead_letter, &raised[0]).await;
        let resumed = store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert!(!resumed.created, "the same wrap-up");
        assert_eq!(resumed.wrap_up.unwrap().wrap_up_id, id);
        assert_eq!(requests(&db, &id).await.len(), 2, "asked again");
        store.request_wrap_up(actor, 2024, None).await.unwrap();
        assert_eq!(requests(&db, &id).await.len(), 2, "the new request is under way");
    }
}
