//! Integrations: importing a Letterboxd diary, one transaction per chunk of rows.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::letterboxd::DiaryRow;
use reelay_domain::{NewEvent, ReviewId, UserId};
use reelay_outbox::WriteTx;

use super::reviews::save_edit;
use super::{
    ImportSummary, MovieSpec, Result, ReviewRow, Store, commit_events, ensure_user, insert_review, resolve_movie,
    review_logged, select_reviews, write_job,
};
use crate::request_ids::RequestKey;

/// Diary rows committed per import transaction.
pub const IMPORT_CHUNK_ROWS: usize = 250;

impl Store {
    /// Checks that the importing user exists before any chunk is written.
    pub async fn user_exists(&self, user: UserId) -> Result<bool> {
        Ok(sqlx::query("SELECT 1 FROM users WHERE id = ?")
            .bind(user.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .is_some())
    }

    /// Imports validated diary rows, one transaction per chunk of [`IMPORT_CHUNK_ROWS`] with
    /// each row's events and a `DiaryImported` summary. Rows imported before are skipped.
    ///
    /// With a request key, the first chunk's transaction looks for the answer of an earlier call
    /// (and returns it, writing nothing) and otherwise takes the key, so an import of another
    /// file under it is refused before it writes a row; the last chunk's records the answer. A
    /// retry of an import that broke off half way imports the rest; the rows already in are
    /// skipped.
    pub async fn import_diary(
        &self,
        actor: UserId,
        import_id: String,
        rows: Vec<DiaryRow>,
        without_year: u32,
        key: Option<RequestKey>,
    ) -> Result<v1::ImportDiaryResponse> {
        let mut summary = ImportSummary { rows: rows.len() as u32, without_year, ..Default::default() };
        let chunks = rows.chunks(IMPORT_CHUNK_ROWS).count();
        for (chunk_index, chunk) in rows.chunks(IMPORT_CHUNK_ROWS).enumerate() {
            let chunk = chunk.to_vec();
            let (import_id, key) = (import_id.clone(), key.clone());
            let (first, last, so_far) = (chunk_index == 0, chunk_index + 1 == chunks, summary.clone());
            let step = write_job!(self, "import_diary", |tx| {
                if let Some(key) = key.as_ref().filter(|_| first || last) {
                    if let Some(answer) = key.recorded(tx).await? {
                        return Ok(ImportStep::Answered(answer));
                    }
                    if first {
                        key.reserve(tx).await?;
                    }
                }
                ensure_user(tx.conn(), actor).await?;
                let mut events = Vec::new();
                let (mut imported, mut skipped, mut discovered, mut completed) = (0u32, 0u32, 0u32, 0u32);
                for row in &chunk {
                    let import_key = format!("{actor}|{}", row.import_key());
                    let seen: Option<ReviewRow> = sqlx::query_as(select_reviews!("WHERE import_key = ?"))
                        .bind(import_key.clone())
                        .fetch_optional(tx.conn())
                        .await?;
                    if let Some(review) = seen {
                        skipped += 1;
                        if let Some(event) = complete(tx, review, row).await? {
                            events.push(event);
                            completed += 1;
                        }
                        continue;
                    }
                    let deleted = sqlx::query("SELECT 1 FROM deleted_imports WHERE import_key = ?")
                        .bind(import_key.clone())
                        .fetch_optional(tx.conn())
                        .await?;
                    if deleted.is_some() {
                        // Imported before, and deleted since by its user.
                        skipped += 1;
                        continue;
                    }
                    let spec = MovieSpec::TitleYear {
                        title: row.title.clone(),
                        year: row.year,
                        external_id: None,
                        external_id_field: String::new(),
                    };
                    let (movie, created) = resolve_movie(tx, &spec, &mut events).await?;
                    discovered += u32::from(created);
                    let now = tx.now_ms();
                    let review = ReviewRow {
                        id: ReviewId::new().to_string(),
                        user_id: actor.to_string(),
                        movie_id: movie.id.clone(),
                        rating: i64::from(row.rating),
                        body: row.body.clone(),
                        watched_on: row.watched_on.clone(),
                        rewatch: row.rewatch,
                        source: "import".into(),
                        created_at: now,
                        updated_at: now,
                    };
                    insert_review(tx.conn(), &review, Some(import_key)).await?;
                    events.push(review_logged(&review, &movie, v1::ReviewSource::Import));
                    imported += 1;
                }
                if imported > 0 {
                    events.push(NewEvent::new(
                        actor,
                        Payload::DiaryImported(v1::DiaryImported {
                            import_id: import_id.clone(),
                            user_id: actor.to_string(),
                            chunk: chunk_index as u32,
                            imported,
                            skipped_duplicates: skipped,
                        }),
                    ));
                }
                commit_events(tx, events).await?;
                let mut summary = so_far;
                summary.imported += imported;
                summary.skipped_duplicates += skipped;
                summary.movies_discovered += discovered;
                summary.completed += completed;
                if last && let Some(key) = &key {
                    key.record(tx, &summary.response(import_id)).await?;
                }
                Ok(ImportStep::Imported(summary))
            })
            .await?;
            match step {
                ImportStep::Answered(answer) => return Ok(answer),
                ImportStep::Imported(so_far) => summary = so_far,
            }
        }
        Ok(summary.response(import_id))
    }
}

/// An entry imported before, met again: the text and rating it lacks and `row` has are filled
/// in (a diary imported first and its reviews.csv after, or an export made after a review was
/// written). What it has is kept, edited in Reelay or not. Returns its `ReviewEdited`, if
/// anything changed.
async fn complete(tx: &mut WriteTx, mut review: ReviewRow, row: &DiaryRow) -> Result<Option<NewEvent>> {
    let body = review.body.is_empty() && !row.body.is_empty();
    let rating = review.rating == 0 && row.rating > 0;
    if !body && !rating {
        return Ok(None);
    }
    if body {
        review.body = row.body.clone();
    }
    if rating {
        review.rating = i64::from(row.rating);
    }
    Ok(Some(save_edit(tx, &mut review, v1::ReviewSource::Import).await?))
}

/// What one chunk's transaction did.
enum ImportStep {
    /// The import was made before under the same request key: its answer.
    Answered(v1::ImportDiaryResponse),
    /// The running totals after this chunk.
    Imported(ImportSummary),
}

impl ImportSummary {
    fn response(&self, import_id: String) -> v1::ImportDiaryResponse {
        v1::ImportDiaryResponse {
            import_id,
            rows: self.rows,
            imported: self.imported,
            skipped_duplicates: self.skipped_duplicates,
            movies_discovered: self.movies_discovered,
            completed: self.completed,
            skipped_without_year: self.without_year,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` rows of one export, four chunks' worth for 1,000.
    fn export(file: &str, count: usize) -> Vec<DiaryRow> {
        (0..count)
            .map(|n| DiaryRow {
                line: n as u64 + 2,
                title: format!("{file} film {n}"),
                year: 1990,
                letterboxd_uri: format!("https://boxd.it/{file}{n}"),
                rating: 7,
                rewatch: false,
                body: String::new(),
                watched_on: "2024-03-01".into(),
            })
            .collect()
    }

    async fn reviews(store: &Store) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM reviews").fetch_one(&store.db.reads).await.unwrap()
    }

    /// Two different files imported at once under one request id: one is imported, the other
    /// is refused before it writes a row (its chunks commit one by one, so a key answered only
    /// by the last chunk let its middle chunks in). A retry of a file whose import broke off
    /// half way imports the rest, and a retry after the answer gets the answer.
    #[tokio::test]
    async fn one_request_id_imports_one_file() {
        let (_dir, _db, store, actor) = super::super::store_with_ana().await;
        let key = |request_id: &str, file: &str| {
            RequestKey::from_parts("ImportDiary", &actor.to_string(), request_id, &[file.as_bytes()]).unwrap()
        };
        let import = |id: &str, file: &str, request_id: &str| {
            store.import_diary(actor, id.into(), export(file, 1000), 0, key(request_id, file))
        };

        let (a, b) = tokio::join!(import("a", "a", "import-1"), import("b", "b", "import-1"));
        let (answered, refused) = match (a, b) {
            (Ok(answer), Err(error)) | (Err(error), Ok(answer)) => (answer, error),
            other => panic!("one import is answered and one refused, got {other:?}"),
        };
        assert_eq!(answered.imported, 1000);
        assert!(format!("{refused:?}").contains("already used for a different ImportDiary"), "{refused:?}");
        assert_eq!(reviews(&store).await, 1000, "the refused file wrote nothing");
        let again = import(&answered.import_id, &answered.import_id, "import-1").await.unwrap();
        assert_eq!(again, answered, "a retry gets the first call's answer");
        assert_eq!(reviews(&store).await, 1000);

        // An import dropped once its first chunk is in (a client gone), then retried.
        tokio::select! {
            broken = import("c", "c", "import-2") => panic!("the import ended before it was dropped: {broken:?}"),
            () = async { while reviews(&store).await < 1250 { tokio::task::yield_now().await } } => {}
        }
        // A retention purge (here of every key) leaves the key of an import under way.
        let purged = store
            .db
            .writer
            .transact::<_, crate::WriteError, _>("purge", |tx: &mut WriteTx| {
                Box::pin(async move { Ok(crate::request_ids::purge(tx, reelay_kit::now_ms() + 1_000, 100).await?) })
            })
            .await
            .unwrap();
        assert_eq!(purged, 1, "the finished import's key went");
        let other = import("d", "d", "import-2").await.expect_err("another file under the key of one under way");
        assert!(format!("{other:?}").contains("already used for a different ImportDiary"), "{other:?}");
        let retried = import("c2", "c", "import-2").await.unwrap();
        assert_eq!(retried.imported + retried.skipped_duplicates, 1000);
        assert!(retried.skipped_duplicates >= 250, "{retried:?}");
        assert_eq!(reviews(&store).await, 2000, "the refused file wrote nothing either");
    }
}
