//! The search index: one tantivy index in a local directory, holding one document per movie,
//! local review and remote review, each under a key (`movie:<id>`, `review:<id>`, `remote:<id>`),
//! and one document per movie poster (`posters:<id>`: the sizes stored, read beside a movie hit).
//!
//! Events arrive at least once and in any order, so every document carries the `version` of the
//! event that wrote it (its `occurred_at_us`, which the write service makes later for every event
//! it writes, so two edits within one millisecond are ordered too) and a `deleted` flag. An event older than the
//! indexed document is a no-op, and a delete leaves a tombstone rather than nothing, so a
//! redelivered `ReviewLogged` cannot bring back a review deleted after it. A change writes only
//! when it is newer than the indexed document; at equal versions a tombstone beats an upsert, and
//! an equal change (a redelivery) writes nothing, so it does not even shift relevance scores.
//!
//! Only this module touches tantivy; all of its blocking work runs on the blocking pool.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use reelay_contracts::v1::{self, event::Payload};
use reelay_delivery::HandlerError;
use tantivy::collector::{Count, TopDocs};
use tantivy::directory::MmapDirectory;
use tantivy::indexer::IndexWriterOptions;
use tantivy::query::{BooleanQuery, ConstScoreQuery, Occur, Query, TermQuery};
use tantivy::schema::{Field, INDEXED, IndexRecordOption, STORED, STRING, Schema, TEXT, Value};
use tantivy::{Index, IndexReader, IndexWriter, ReloadPolicy, Score, Searcher, TantivyDocument, Term};

/// Tantivy's minimum per indexing thread; with one thread it keeps the writer's buffer, and so
/// the service, well under its 64 MB memory budget.
const WRITER_MEMORY_BYTES: usize = 15_000_000;

const KIND_MOVIE: &str = "movie";
const KIND_REVIEW: &str = "review";
const KIND_POSTERS: &str = "posters";

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("failed to open the search index at {path}: {source}")]
    Open { path: PathBuf, source: tantivy::TantivyError },
    #[error("search index operation failed: {0}")]
    Tantivy(#[from] tantivy::TantivyError),
    #[error("search index task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// One page of hits and the number of hits over all pages.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchPage<T> {
    pub hits: Vec<T>,
    pub total_hits: u64,
}

/// A handle on the index; clones share one reader and one writer.
#[derive(Clone)]
pub struct SearchIndex {
    inner: Arc<Inner>,
}

/// How long a batch waits for others to share its commit.
const COMMIT_LINGER: std::time::Duration = std::time::Duration::from_millis(20);

struct Inner {
    /// To make the writer anew when a rollback could not (it gave the old one up).
    index: Index,
    reader: IndexReader,
    /// Tantivy allows one writer per index; the mutex also makes each batch's read-check-write
    /// of versions atomic with respect to other batches. `None`: the writer was given up and no
    /// new one could be made yet (the next batch tries again).
    writer: Mutex<Option<IndexWriter>>,
    /// Batches waiting for a commit. Whoever holds the writer commits every batch queued by then
    /// in one commit (a commit fsyncs several files, so it is the cost worth sharing).
    queue: Mutex<Vec<Queued>>,
    /// The reader missed a commit (its reload failed): the next batch reloads it before it
    /// reads versions, or it would compare them against the index as it was before that commit
    /// (a late, older change could then replace a newer one, or bring a deleted review back).
    reader_stale: std::sync::atomic::AtomicBool,
    fields: Fields,
}

/// The index's one writer.
fn new_writer(index: &Index) -> tantivy::Result<IndexWriter> {
    index.writer_with_options(
        IndexWriterOptions::builder()
            .memory_budget_per_thread(WRITER_MEMORY_BYTES)
            .num_worker_threads(1)
            .num_merge_threads(1)
            .build(),
    )
}

/// A batch's changes and where to report its commit's outcome.
struct Queued {
    changes: Vec<Change>,
    done: tokio::sync::oneshot::Sender<Result<(), String>>,
}

#[derive(Clone, Copy)]
struct Fields {
    key: Field,
    kind: Field,
    version: Field,
    deleted: Field,
    movie_id: Field,
    title: Field,
    year: Field,
    review_id: Field,
    user_id: Field,
    actor_uri: Field,
    rating: Field,
    body: Field,
    remote: Field,
}

fn schema() -> Schema {
    let mut builder = Schema::builder();
    builder.add_text_field("key", STRING | STORED);
    builder.add_text_field("kind", STRING);
    builder.add_i64_field("version", STORED);
    builder.add_bool_field("deleted", INDEXED | STORED);
    builder.add_text_field("movie_id", STORED);
    // A review's movie title goes here too, so searching "heat" finds reviews of Heat.
    builder.add_text_field("title", TEXT | STORED);
    builder.add_i64_field("year", STORED);
    builder.add_text_field("review_id", STORED);
    builder.add_text_field("user_id", STORED);
    builder.add_text_field("actor_uri", STORED);
    builder.add_u64_field("rating", STORED);
    builder.add_text_field("body", TEXT | STORED);
    builder.add_bool_field("remote", STORED);
    builder.build()
}

impl Fields {
    fn of(schema: &Schema) -> tantivy::Result<Self> {
        let field = |name| schema.get_field(name);
        Ok(Self {
            key: field("key")?,
            kind: field("kind")?,
            version: field("version")?,
            deleted: field("deleted")?,
            movie_id: field("movie_id")?,
            title: field("title")?,
            year: field("year")?,
            review_id: field("review_id")?,
            user_id: field("user_id")?,
            actor_uri: field("actor_uri")?,
            rating: field("rating")?,
            body: field("body")?,
            remote: field("remote")?,
        })
    }
}

/// What one event does to the index.
struct Change {
    key: String,
    version: i64,
    /// `None` writes a tombstone.
    entry: Option<Entry>,
}

enum Entry {
    Movie(v1::MovieHit),
    Review(v1::ReviewHit),
    /// A movie's stored poster sizes.
    Posters {
        movie_id: String,
        sizes: Vec<String>,
    },
}

/// Orders the writes to one key: a newer version wins, and at the same version a tombstone wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Stamp {
    version: i64,
    deleted: bool,
}

/// Versions below this are milliseconds (documents and events from before `occurred_at_us`):
/// 10^14 ms is the year 5138, 10^14 µs the year 1973.
const MICROS_FROM: i64 = 100_000_000_000_000;

/// An event's version: its `occurred_at_us`, or for an event from before it, the last
/// microsecond of its millisecond (not newer than a document of the same millisecond, as
/// before, nor older than an edit made later within that millisecond: its order there is not
/// known).
fn event_version(event: &v1::Event) -> i64 {
    if event.occurred_at_us > 0 { event.occurred_at_us } else { stored_version(event.occurred_at_ms) }
}

/// A document's stored version in microseconds (one indexed before versions were: see
/// [`event_version`]).
fn stored_version(version: i64) -> i64 {
    if (0..MICROS_FROM).contains(&version) { version.saturating_mul(1000).saturating_add(999) } else { version }
}

impl Change {
    /// A movie's document (keyed by the movie, so enrichment replaces what discovery indexed).
    fn movie(version: i64, hit: v1::MovieHit) -> Self {
        Self { key: format!("movie:{}", hit.movie_id), version, entry: Some(Entry::Movie(hit)) }
    }

    /// A movie's poster sizes: the original and `variants`.
    fn posters(version: i64, movie_id: &str, variants: Vec<String>) -> Self {
        let sizes = std::iter::once("original".to_owned()).chain(variants).collect();
        Self {
            key: format!("posters:{movie_id}"),
            version,
            entry: Some(Entry::Posters { movie_id: movie_id.to_owned(), sizes }),
        }
    }

    fn stamp(&self) -> Stamp {
        Stamp { version: self.version, deleted: self.entry.is_none() }
    }

    /// None for events the index does not care about.
    fn from_event(event: &v1::Event) -> Result<Vec<Self>, HandlerError> {
        let Some(payload) = &event.payload else { return Ok(Vec::new()) };
        let version = event_version(event);
        let require = |field: &str, value: &str| {
            if value.is_empty() {
                Err(HandlerError::permanent(format!(
                    "{} event {} has an empty {field}",
                    event.event_type, event.event_id
                )))
            } else {
                Ok(())
            }
        };
        let change = match payload {
            // Both carry the whole review, so an edit replaces the document as a log creates it.
            Payload::ReviewLogged(v1::ReviewLogged {
                review_id,
                user_id,
                movie_id,
                rating,
                body,
                movie_title,
                movie_year,
                ..
            })
            | Payload::ReviewEdited(v1::ReviewEdited {
                review_id,
                user_id,
                movie_id,
                rating,
                body,
                movie_title,
                movie_year,
                ..
            }) => {
                require("review_id", review_id)?;
                Self {
                    key: format!("review:{review_id}"),
                    version,
                    entry: Some(Entry::Review(v1::ReviewHit {
                        review_id: review_id.clone(),
                        user_id: user_id.clone(),
                        actor_uri: String::new(),
                        movie_id: movie_id.clone(),
                        movie_title: movie_title.clone(),
                        movie_year: *movie_year,
                        rating: *rating,
                        body: body.clone(),
                        remote: false,
                        score: 0.0,
                    })),
                }
            }
            Payload::ReviewDeleted(r) => {
                require("review_id", &r.review_id)?;
                Self { key: format!("review:{}", r.review_id), version, entry: None }
            }
            Payload::RemoteReviewDeleted(r) => {
                require("remote_review_id", &r.remote_review_id)?;
                Self { key: format!("remote:{}", r.remote_review_id), version, entry: None }
            }
            Payload::RemoteReviewSaved(r) => {
                require("remote_review_id", &r.remote_review_id)?;
                Self {
                    key: format!("remote:{}", r.remote_review_id),
                    version,
                    entry: Some(Entry::Review(v1::ReviewHit {
                        review_id: r.remote_review_id.clone(),
                        user_id: String::new(),
                        actor_uri: r.actor_uri.clone(),
                        movie_id: r.movie_id.clone(),
                        movie_title: r.movie_title.clone(),
                        movie_year: r.movie_year,
                        rating: r.rating,
                        body: r.body.clone(),
                        remote: true,
                        score: 0.0,
                    })),
                }
            }
            Payload::MovieDiscovered(m) => {
                require("movie_id", &m.movie_id)?;
                Self::movie(
                    version,
                    v1::MovieHit {
                        movie_id: m.movie_id.clone(),
                        title: m.title.clone(),
                        year: m.year,
                        ..Default::default()
                    },
                )
            }
            // The same document, now with who made it and what it is: a director's name or a
            // genre finds the film.
            Payload::MovieEnriched(m) => {
                require("movie_id", &m.movie_id)?;
                let profile = m.profile.clone().unwrap_or_default();
                Self::movie(
                    version,
                    v1::MovieHit {
                        movie_id: m.movie_id.clone(),
                        title: m.title.clone(),
                        year: m.year,
                        directors: profile.directors.into_iter().map(|d| d.name).collect(),
                        genres: profile.genres,
                        ..Default::default()
                    },
                )
            }
            // Its poster sizes go with it.
            Payload::MovieDeleted(m) => {
                require("movie_id", &m.movie_id)?;
                return Ok(["movie", "posters"]
                    .map(|kind| Self { key: format!("{kind}:{}", m.movie_id), version, entry: None })
                    .into());
            }
            // A poster's sizes live in their own document, so neither writer of a movie's
            // document (discovery, enrichment) has to know them.
            Payload::PosterSynced(p) => {
                require("movie_id", &p.movie_id)?;
                Self::posters(version, &p.movie_id, Vec::new())
            }
            Payload::PosterConverted(p) => {
                require("movie_id", &p.movie_id)?;
                Self::posters(version, &p.movie_id, p.sizes.clone())
            }
            _ => return Ok(Vec::new()),
        };
        Ok(vec![change])
    }
}

impl SearchIndex {
    /// Opens the index in `dir`, creating the directory and an empty index if needed. Fails if
    /// another process holds the index's writer lock.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, IndexError> {
        let path = dir.as_ref();
        let open = || -> tantivy::Result<Self> {
            std::fs::create_dir_all(path)?;
            let index = Index::open_or_create(MmapDirectory::open(path)?, schema())?;
            Self::from_index(index)
        };
        let index = open().map_err(|source| IndexError::Open { path: path.to_owned(), source })?;
        tracing::info!(path = %path.display(), docs = index.num_docs(), "search index open");
        Ok(index)
    }

    fn from_index(index: Index) -> tantivy::Result<Self> {
        // Before the writer exists: its segments take the text fields' analyzer from here.
        index.tokenizers().register(crate::words::ANALYZER, crate::words::Words::default());
        let fields = Fields::of(&index.schema())?;
        let writer = new_writer(&index)?;
        // Only our own commits change the index, and each one reloads explicitly.
        let reader = index.reader_builder().reload_policy(ReloadPolicy::Manual).try_into()?;
        Ok(Self {
            inner: Arc::new(Inner {
                index,
                reader,
                writer: Mutex::new(Some(writer)),
                queue: Mutex::new(Vec::new()),
                reader_stale: std::sync::atomic::AtomicBool::new(false),
                fields,
            }),
        })
    }

    /// Documents in the index, tombstones included.
    pub fn num_docs(&self) -> u64 {
        self.inner.reader.searcher().num_docs()
    }

    /// Applies the events of one batch with a single commit, returning one result per event in
    /// order. Events the index does not index are `Ok` no-ops; an event missing its id is a
    /// permanent error; a failed commit (a full disk, an I/O error) says the index is
    /// unavailable, for every event it would have written, and they are held until a commit
    /// passes. Searches see the batch once this returns.
    pub async fn apply(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
        let mut results = Vec::with_capacity(events.len());
        let mut changes = Vec::new();
        let mut changed = Vec::new();
        for (position, event) in events.iter().enumerate() {
            match Change::from_event(event) {
                Ok(these) if !these.is_empty() => {
                    changes.extend(these);
                    changed.push(position);
                    results.push(Ok(()));
                }
                Ok(_) => results.push(Ok(())),
                Err(error) => {
                    tracing::warn!(event_id = %event.event_id, event_type = %event.event_type, %error, "event cannot be indexed");
                    results.push(Err(error));
                }
            }
        }
        if changes.is_empty() {
            return results;
        }
        let (done, committed) = tokio::sync::oneshot::channel();
        self.inner.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(Queued { changes, done });
        // Let batches arriving meanwhile join this commit: each commit fsyncs several files,
        // and at a steady trickle of events those fsyncs would crowd the disk that SQLite's
        // commits (and so every other handler's delivery) wait on.
        tokio::time::sleep(COMMIT_LINGER).await;
        let inner = Arc::clone(&self.inner);
        let drained = tokio::task::spawn_blocking(move || inner.commit_queued()).await;
        // The commit's failure is the index's, whichever events it held; a panic (the task
        // failed) may be an event's doing, and is retried as a failure of them.
        let failed = match drained {
            Ok(()) => committed
                .await
                .unwrap_or_else(|_| Err("the index writer stopped".to_owned()))
                .err()
                .map(HandlerError::unavailable),
            Err(error) => Some(HandlerError::retryable(IndexError::from(error))),
        };
        if let Some(error) = failed {
            tracing::warn!(events = changed.len(), %error, "search index batch failed");
            for position in changed {
                results[position] = Err(error.clone());
            }
        }
        results
    }

    /// Movies whose title, directors or genres hold every word of `query`, best first.
    pub async fn search_movies(
        &self,
        query: &str,
        offset: usize,
        limit: usize,
    ) -> Result<SearchPage<v1::MovieHit>, IndexError> {
        let inner = Arc::clone(&self.inner);
        let query = query.to_owned();
        tokio::task::spawn_blocking(move || {
            let fields = inner.fields;
            let mut page =
                inner.search(KIND_MOVIE, &[fields.title, fields.body], &query, offset, limit, |score, doc| {
                    let (directors, genres) = movie_credits(&text(doc, fields.body));
                    v1::MovieHit {
                        movie_id: text(doc, fields.movie_id),
                        title: text(doc, fields.title),
                        year: int(doc, fields.year),
                        score,
                        directors,
                        genres,
                        poster_sizes: Vec::new(),
                    }
                })?;
            let searcher = inner.reader.searcher();
            for hit in &mut page.hits {
                hit.poster_sizes = inner.poster_sizes(&searcher, &hit.movie_id)?;
            }
            Ok(page)
        })
        .await?
    }

    /// Local and remote reviews whose body or movie title holds every word of `query`, best first.
    pub async fn search_reviews(
        &self,
        query: &str,
        offset: usize,
        limit: usize,
    ) -> Result<SearchPage<v1::ReviewHit>, IndexError> {
        let inner = Arc::clone(&self.inner);
        let query = query.to_owned();
        tokio::task::spawn_blocking(move || {
            let fields = inner.fields;
            inner.search(KIND_REVIEW, &[fields.title, fields.body], &query, offset, limit, |score, doc| v1::ReviewHit {
                review_id: text(doc, fields.review_id),
                user_id: text(doc, fields.user_id),
                actor_uri: text(doc, fields.actor_uri),
                movie_id: text(doc, fields.movie_id),
                movie_title: text(doc, fields.title),
                movie_year: int(doc, fields.year),
                rating: doc.get_first(fields.rating).and_then(|v| v.as_u64()).unwrap_or(0) as u32,
                body: text(doc, fields.body),
                remote: doc.get_first(fields.remote).and_then(|v| v.as_bool()).unwrap_or(false),
                score,
            })
        })
        .await?
    }
}

/// Between two entries of a movie document's lists: a control character, which no name or genre
/// holds (the write API refuses them, the enrichment handlers make them spaces). Documents
/// written before it have no leading one and `|` between entries, which a name may hold.
const ENTRY: char = '\u{1f}';

/// A movie document keeps its directors and genres in `body` (a movie has no text of its own):
/// `␟<director>␟<director>\t<genre>␟<genre>` (␟ is [`ENTRY`]), which the tokenizer splits into
/// words.
fn movie_body(movie: &v1::MovieHit) -> String {
    let entry = ENTRY.to_string();
    format!("{ENTRY}{}\t{}", movie.directors.join(&entry), movie.genres.join(&entry))
}

fn movie_credits(body: &str) -> (Vec<String>, Vec<String>) {
    let (body, entry) = match body.strip_prefix(ENTRY) {
        Some(body) => (body, ENTRY),
        None => (body, '|'),
    };
    let (directors, genres) = body.split_once('\t').unwrap_or((body, ""));
    (entries(directors, entry), entries(genres, entry))
}

/// The entries of a list joined by `between`.
fn entries(list: &str, between: char) -> Vec<String> {
    list.split(between).filter(|p| !p.is_empty()).map(str::to_owned).collect()
}

fn text(doc: &TantivyDocument, field: Field) -> String {
    doc.get_first(field).and_then(|v| v.as_str()).unwrap_or_default().to_owned()
}

fn int(doc: &TantivyDocument, field: Field) -> i32 {
    doc.get_first(field).and_then(|v| v.as_i64()).unwrap_or(0) as i32
}

impl Inner {
    /// Takes the writer, then commits every queued batch at once and tells each the outcome.
    /// A batch that another caller's commit already took finds the queue empty.
    fn commit_queued(&self) {
        let mut writer = match self.writer.lock() {
            Ok(writer) => writer,
            Err(poisoned) => poisoned.into_inner(),
        };
        let queued = std::mem::take(&mut *self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        if queued.is_empty() {
            return;
        }
        let (changes, waiters): (Vec<Vec<Change>>, Vec<_>) = queued.into_iter().map(|q| (q.changes, q.done)).unzip();
        let outcome = self.write(&mut writer, changes.into_iter().flatten().collect()).map_err(|e| e.to_string());
        for waiter in waiters {
            let _ = waiter.send(outcome.clone());
        }
    }

    fn write(&self, slot: &mut Option<IndexWriter>, changes: Vec<Change>) -> Result<(), IndexError> {
        if self.writer.is_poisoned() {
            // A batch panicked half-staged: drop what it staged before staging anew.
            self.roll_back(slot);
            self.writer.clear_poison();
        }
        if self.reader_stale.load(std::sync::atomic::Ordering::SeqCst) {
            self.reader.reload()?;
            self.reader_stale.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        let committed = {
            let writer = match slot {
                Some(writer) => writer,
                None => {
                    let writer = slot.insert(new_writer(&self.index)?);
                    tracing::info!("search index: a new writer was made");
                    writer
                }
            };
            let staged = self.stage(writer, changes);
            staged.and_then(|written| if written > 0 { writer.commit().map(drop) } else { Ok(()) })
        };
        if let Err(error) = committed {
            self.roll_back(slot);
            return Err(error.into());
        }
        // Still under the lock, so the next batch checks versions against this one.
        if let Err(error) = self.reader.reload() {
            self.reader_stale.store(true, std::sync::atomic::Ordering::SeqCst);
            return Err(error.into());
        }
        Ok(())
    }

    /// Drops what the writer staged. Should the rollback fail, it has given its writer up: a
    /// new one is made, so the batches after this one can still be written (none made, the slot
    /// is left empty and the next batch tries again).
    fn roll_back(&self, slot: &mut Option<IndexWriter>) {
        let Some(Err(rollback)) = slot.as_mut().map(IndexWriter::rollback) else { return };
        tracing::error!(%rollback, "search index rollback failed; making a new writer");
        *slot = new_writer(&self.index)
            .inspect_err(|error| {
                tracing::error!(%error, "search index: no new writer either; the next batch tries again");
            })
            .ok();
    }

    /// Stages the changes newer than what is indexed; returns how many it staged.
    fn stage(&self, writer: &IndexWriter, changes: Vec<Change>) -> tantivy::Result<usize> {
        let searcher = self.reader.searcher();
        // Changes staged by this batch are not visible to the searcher yet.
        let mut staged: HashMap<String, Stamp> = HashMap::new();
        for change in changes {
            let current = match staged.get(&change.key) {
                Some(stamp) => Some(*stamp),
                None => self.indexed_stamp(&searcher, &change.key)?,
            };
            let stamp = change.stamp();
            if let Some(current) = current.filter(|current| stamp <= *current) {
                tracing::debug!(key = %change.key, version = stamp.version, indexed_version = current.version, indexed_deleted = current.deleted, "skipped a change not newer than the indexed document");
                continue;
            }
            writer.delete_term(Term::from_field_text(self.fields.key, &change.key));
            writer.add_document(self.document(&change))?;
            staged.insert(change.key, stamp);
        }
        tracing::debug!(staged = staged.len(), "staged search index changes");
        Ok(staged.len())
    }

    /// The document under `key`, tombstones included.
    fn keyed(&self, searcher: &Searcher, key: &str) -> tantivy::Result<Option<TantivyDocument>> {
        let query = TermQuery::new(Term::from_field_text(self.fields.key, key), IndexRecordOption::Basic);
        let Some((_, address)) = searcher.search(&query, &TopDocs::with_limit(1).order_by_score())?.pop() else {
            return Ok(None);
        };
        searcher.doc(address).map(Some)
    }

    /// The poster sizes stored for `movie_id` (none when no poster is).
    fn poster_sizes(&self, searcher: &Searcher, movie_id: &str) -> tantivy::Result<Vec<String>> {
        let doc = self.keyed(searcher, &format!("posters:{movie_id}"))?;
        Ok(doc.map(|doc| entries(&text(&doc, self.fields.body), '|')).unwrap_or_default())
    }

    fn indexed_stamp(&self, searcher: &Searcher, key: &str) -> tantivy::Result<Option<Stamp>> {
        let Some(doc) = self.keyed(searcher, key)? else { return Ok(None) };
        Ok(Some(Stamp {
            version: doc.get_first(self.fields.version).and_then(|v| v.as_i64()).map_or(i64::MIN, stored_version),
            deleted: doc.get_first(self.fields.deleted).and_then(|v| v.as_bool()).unwrap_or(false),
        }))
    }

    fn document(&self, change: &Change) -> TantivyDocument {
        let f = &self.fields;
        let mut doc = TantivyDocument::new();
        doc.add_text(f.key, &change.key);
        doc.add_i64(f.version, change.version);
        doc.add_bool(f.deleted, change.entry.is_none());
        match &change.entry {
            None => {}
            Some(Entry::Movie(movie)) => {
                doc.add_text(f.kind, KIND_MOVIE);
                doc.add_text(f.movie_id, &movie.movie_id);
                doc.add_text(f.title, &movie.title);
                doc.add_i64(f.year, movie.year.into());
                doc.add_text(f.body, movie_body(movie));
            }
            Some(Entry::Posters { movie_id, sizes }) => {
                doc.add_text(f.kind, KIND_POSTERS);
                doc.add_text(f.movie_id, movie_id);
                doc.add_text(f.body, sizes.join("|"));
            }
            Some(Entry::Review(review)) => {
                doc.add_text(f.kind, KIND_REVIEW);
                doc.add_text(f.review_id, &review.review_id);
                doc.add_text(f.user_id, &review.user_id);
                doc.add_text(f.actor_uri, &review.actor_uri);
                doc.add_text(f.movie_id, &review.movie_id);
                doc.add_text(f.title, &review.movie_title);
                doc.add_i64(f.year, review.movie_year.into());
                doc.add_u64(f.rating, review.rating.into());
                doc.add_text(f.body, &review.body);
                doc.add_bool(f.remote, review.remote);
            }
        }
        doc
    }

    /// Documents of `kind` with every word of `text` in one of `fields`, best first, tombstones
    /// excluded. Query syntax is not interpreted: what is asked for is [`crate::words::query`]'s.
    fn search<T>(
        &self,
        kind: &str,
        fields: &[Field],
        text: &str,
        offset: usize,
        limit: usize,
        hit: impl Fn(Score, &TantivyDocument) -> T,
    ) -> Result<SearchPage<T>, IndexError> {
        let wanted = crate::words::query(text);
        if wanted.is_empty() {
            return Ok(SearchPage { hits: Vec::new(), total_hits: 0 });
        }
        let filter = |term| -> (Occur, Box<dyn Query>) {
            // Filters must not shift the relevance score.
            (Occur::Must, Box::new(ConstScoreQuery::new(Box::new(TermQuery::new(term, IndexRecordOption::Basic)), 0.0)))
        };
        let mut clauses = vec![
            filter(Term::from_field_text(self.fields.kind, kind)),
            filter(Term::from_field_bool(self.fields.deleted, false)),
        ];
        let in_any_field = |word: &String| -> Box<dyn Query> {
            let terms = fields
                .iter()
                .map(|field| -> Box<dyn Query> {
                    Box::new(TermQuery::new(Term::from_field_text(*field, word), IndexRecordOption::WithFreqs))
                })
                .collect();
            Box::new(BooleanQuery::union(terms))
        };
        for want in &wanted {
            let clause: Box<dyn Query> = match &want.alternatives[..] {
                [words] if words.len() == 1 => in_any_field(&words[0]),
                alternatives => Box::new(BooleanQuery::union(
                    alternatives
                        .iter()
                        .map(|words| -> Box<dyn Query> {
                            Box::new(BooleanQuery::intersection(words.iter().map(in_any_field).collect()))
                        })
                        .collect(),
                )),
            };
            clauses.push((Occur::Must, clause));
        }
        let query = BooleanQuery::new(clauses);
        let searcher = self.reader.searcher();
        // TopDocs panics on a zero limit.
        let top = TopDocs::with_limit(limit.max(1)).and_offset(offset).order_by_score();
        let (top, total_hits) = searcher.search(&query, &(top, Count))?;
        let hits = top
            .into_iter()
            .take(limit)
            .map(|(score, address)| Ok(hit(score, &searcher.doc(address)?)))
            .collect::<tantivy::Result<_>>()?;
        Ok(SearchPage { hits, total_hits: total_hits as u64 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::*;

    fn open(dir: &tempfile::TempDir) -> SearchIndex {
        SearchIndex::open(dir.path().join("search")).expect("open the search index")
    }

    async fn apply_ok(index: &SearchIndex, events: &[&v1::Event]) {
        for result in index.apply(events).await {
            result.expect("event applied");
        }
    }

    async fn review_ids(index: &SearchIndex, query: &str) -> Vec<String> {
        let page = index.search_reviews(query, 0, 100).await.expect("search reviews");
        assert_eq!(page.total_hits, page.hits.len() as u64);
        page.hits.into_iter().map(|hit| hit.review_id).collect()
    }

    async fn movie_ids(index: &SearchIndex, query: &str) -> Vec<String> {
        let page = index.search_movies(query, 0, 100).await.expect("search movies");
        page.hits.into_iter().map(|hit| hit.movie_id).collect()
    }

    /// A review whose body the word splitter chokes on is indexed without its words, and
    /// nothing else is held back: the others of its batch, and the batches that shared its
    /// commit, are indexed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_text_the_word_splitter_chokes_on_holds_nothing_back() {
        let dir = tempfile::tempdir().unwrap();
        let index = SearchIndex::open(dir.path()).unwrap();
        let batch = [
            review_logged("r1", 10, "Heat", "diner tension"),
            review_logged("r2", 10, "Heat", crate::words::tests::CHOKES),
            review_logged("r3", 10, "Heat", "harbour tension"),
        ];
        let other = review_logged("r4", 10, "Heat", "airport tension");
        let (a, b) = {
            let (first, second) = (index.clone(), index.clone());
            let batch = batch.clone();
            let one = tokio::spawn(async move { first.apply(&batch.iter().collect::<Vec<_>>()).await });
            let two = tokio::spawn(async move { second.apply(&[&other]).await });
            (one.await.unwrap(), two.await.unwrap())
        };
        assert!(a.iter().chain(&b).all(Result::is_ok), "{a:?} {b:?}");
        let mut found = review_ids(&index, "tension").await;
        found.sort();
        assert_eq!(found, ["r1", "r3", "r4"]);
        assert_eq!(review_ids(&index, "heat").await.len(), 4, "the choking review is there, by its film's title");
        assert!(review_ids(&index, "splitter").await.is_empty(), "indexed without the words of its body");
    }

    /// Batches applied at the same time share commits, and each learns its own outcome.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_batches_share_commits() {
        let dir = tempfile::tempdir().unwrap();
        let index = SearchIndex::open(dir.path()).unwrap();
        let tasks: Vec<_> = (0..24)
            .map(|i| {
                let index = index.clone();
                tokio::spawn(async move {
                    let event = review_logged(&format!("r{i}"), 10, "Heat", &format!("word{i} tension"));
                    index.apply(&[&event]).await
                })
            })
            .collect();
        for task in tasks {
            assert_eq!(task.await.unwrap(), [Ok(())]);
        }
        assert_eq!(index.search_reviews("tension", 0, 100).await.unwrap().total_hits, 24);
        assert_eq!(index.search_reviews("word7", 0, 10).await.unwrap().total_hits, 1);
    }

    #[tokio::test]
    async fn the_same_event_twice_is_indexed_once() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        let logged = review_logged("r1", 100, "Heat", "the diner scene");
        apply_ok(&index, &[&logged]).await;
        let first = index.search_reviews("diner", 0, 10).await.unwrap();
        let docs = index.num_docs();

        apply_ok(&index, &[&logged]).await;
        apply_ok(&index, &[&logged, &logged]).await;
        assert_eq!(index.search_reviews("diner", 0, 10).await.unwrap(), first);
        assert_eq!(index.num_docs(), docs);
        assert_eq!(first.total_hits, 1);
    }

    #[tokio::test]
    async fn a_logged_review_is_found_by_its_body_and_its_movie_title() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        apply_ok(&index, &[&review_logged("r1", 100, "Heat", "The diner scene is unbearable tension.")]).await;

        assert_eq!(review_ids(&index, "TENSION").await, ["r1"]);
        assert_eq!(review_ids(&index, "heat").await, ["r1"]);
        assert_eq!(review_ids(&index, "heat diner").await, ["r1"], "words may match different fields");
        assert!(review_ids(&index, "heat heist").await.is_empty(), "every word must match");
        assert!(review_ids(&index, "!!!").await.is_empty(), "a query without words finds nothing");
        assert!(movie_ids(&index, "heat").await.is_empty(), "a review is not a movie");

        let hit = index.search_reviews("diner", 0, 1).await.unwrap().hits.remove(0);
        assert_eq!(
            (hit.user_id.as_str(), hit.movie_id.as_str(), hit.movie_title.as_str(), hit.movie_year, hit.rating),
            ("user-ana", "movie-heat", "Heat", 1995, 8)
        );
        assert_eq!((hit.actor_uri.as_str(), hit.remote), ("", false));
        assert!(hit.score > 0.0);
    }

    #[tokio::test]
    async fn an_edit_replaces_the_body_and_an_older_edit_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        apply_ok(&index, &[&review_logged("r1", 100, "Heat", "the diner scene")]).await;
        apply_ok(&index, &[&review_edited("r1", 300, "Heat", "the heist holds up")]).await;
        assert_eq!(review_ids(&index, "heist").await, ["r1"]);
        assert!(review_ids(&index, "diner").await.is_empty());

        // Delivered late: an edit made before the one already indexed.
        apply_ok(&index, &[&review_edited("r1", 200, "Heat", "the diner again")]).await;
        assert_eq!(review_ids(&index, "heist").await, ["r1"]);
        assert!(review_ids(&index, "diner").await.is_empty());
        let hit = index.search_reviews("heist", 0, 1).await.unwrap().hits.remove(0);
        assert_eq!(hit.rating, 10);
    }

    /// Two edits committed in one millisecond (an autosave): the later one wins, whichever
    /// comes first and however often either comes again; and against what was indexed from an
    /// event of before microsecond versions, an event of the same millisecond is not newer and
    /// one of a later millisecond is.
    #[tokio::test]
    async fn edits_within_one_millisecond_keep_the_later() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        let at_us = |mut event: v1::Event, us: i64| {
            event.occurred_at_us = event.occurred_at_ms * 1000 + us;
            event
        };
        let first = at_us(review_edited("r1", 500, "Heat", "the diner scene"), 100);
        let second = at_us(review_edited("r1", 500, "Heat", "the heist holds up"), 101);
        apply_ok(&index, &[&first, &second]).await;
        assert_eq!(review_ids(&index, "heist").await, ["r1"]);
        apply_ok(&index, &[&first]).await;
        apply_ok(&index, &[&second, &first]).await;
        assert_eq!(review_ids(&index, "heist").await, ["r1"]);
        assert!(review_ids(&index, "diner").await.is_empty());

        let r2 = [
            at_us(review_edited("r2", 700, "Heat", "the diner"), 400),
            at_us(review_edited("r2", 700, "Heat", "the heist"), 300),
        ];
        apply_ok(&index, &[&r2[0], &r2[1]]).await;
        assert_eq!(review_ids(&index, "diner").await, ["r2"], "the later is kept though it came first");

        // Indexed from an event without microseconds (millisecond 900).
        apply_ok(&index, &[&review_edited("r3", 900, "Heat", "the coffee")]).await;
        apply_ok(&index, &[&at_us(review_edited("r3", 900, "Heat", "the diner"), 999)]).await;
        assert_eq!(review_ids(&index, "coffee").await, ["r3"], "not newer: the same millisecond");
        apply_ok(&index, &[&at_us(review_edited("r3", 901, "Heat", "the airport"), 0)]).await;
        assert_eq!(review_ids(&index, "airport").await, ["r3"], "newer: a later millisecond");
    }

    #[tokio::test]
    async fn a_deleted_review_stays_deleted_whatever_arrives_late() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        let logged = review_logged("r1", 100, "Heat", "the diner scene");
        apply_ok(&index, &[&logged]).await;
        apply_ok(&index, &[&review_deleted("r1", 300)]).await;
        assert!(review_ids(&index, "diner").await.is_empty());
        assert!(review_ids(&index, "heat").await.is_empty());

        apply_ok(&index, &[&logged, &review_edited("r1", 200, "Heat", "the diner again")]).await;
        assert!(review_ids(&index, "diner").await.is_empty());
        // A log and a delete in the same millisecond: the delete wins in either order.
        apply_ok(&index, &[&review_deleted("r2", 400), &review_logged("r2", 400, "Heat", "the diner")]).await;
        assert!(review_ids(&index, "diner").await.is_empty());
    }

    #[tokio::test]
    async fn a_delete_delivered_before_the_log_hides_it() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        apply_ok(&index, &[&review_deleted("r1", 300), &review_logged("r1", 100, "Heat", "the diner scene")]).await;
        assert!(review_ids(&index, "diner").await.is_empty());
    }

    #[tokio::test]
    async fn movies_are_found_by_title_until_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        let discovered = movie_discovered("m1", 100, "Heat", 1995);
        apply_ok(&index, &[&discovered, &movie_discovered("m2", 100, "The Thing", 1982)]).await;
        assert_eq!(movie_ids(&index, "heat").await, ["m1"]);
        assert_eq!(movie_ids(&index, "thing").await, ["m2"]);
        assert!(review_ids(&index, "heat").await.is_empty(), "a movie is not a review");
        let hit = index.search_movies("heat", 0, 1).await.unwrap().hits.remove(0);
        assert_eq!((hit.title.as_str(), hit.year), ("Heat", 1995));

        let docs = index.num_docs();
        apply_ok(&index, &[&discovered]).await;
        assert_eq!(index.num_docs(), docs);

        apply_ok(&index, &[&movie_deleted("m1", 200)]).await;
        assert!(movie_ids(&index, "heat").await.is_empty());
        apply_ok(&index, &[&discovered]).await;
        assert!(movie_ids(&index, "heat").await.is_empty(), "a redelivered discovery must not resurrect it");
        assert_eq!(movie_ids(&index, "thing").await, ["m2"]);
    }

    #[tokio::test]
    async fn a_remote_review_is_found_and_marked_remote() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        let saved = remote_review_saved("rr1", 100, "Alien", "in space no one can hear you scream");
        apply_ok(&index, &[&saved, &review_logged("r1", 100, "Alien", "scream queen")]).await;

        let page = index.search_reviews("scream", 0, 10).await.unwrap();
        assert_eq!(page.total_hits, 2);
        let remote = page.hits.iter().find(|hit| hit.remote).expect("the remote review");
        assert_eq!(
            (remote.review_id.as_str(), remote.user_id.as_str(), remote.actor_uri.as_str()),
            ("rr1", "", "https://example.social/users/bo")
        );
        assert_eq!((remote.movie_title.as_str(), remote.movie_year, remote.rating), ("Alien", 1979, 6));
        assert!(page.hits.iter().any(|hit| hit.review_id == "r1" && !hit.remote));

        let docs = index.num_docs();
        apply_ok(&index, &[&saved]).await;
        assert_eq!(index.num_docs(), docs);
    }

    #[tokio::test]
    async fn offsets_page_through_every_hit_once() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        let events: Vec<_> =
            (0..25).map(|n| movie_discovered(&format!("m{n}"), 100, &format!("Alien {n}"), 1979)).collect();
        apply_ok(&index, &events.iter().collect::<Vec<_>>()).await;

        let mut seen = Vec::new();
        for offset in (0..25).step_by(10) {
            let page = index.search_movies("alien", offset, 10).await.unwrap();
            assert_eq!(page.total_hits, 25);
            seen.extend(page.hits.into_iter().map(|hit| hit.movie_id));
        }
        let mut unique = seen.clone();
        unique.sort();
        unique.dedup();
        assert_eq!((seen.len(), unique.len()), (25, 25));
        assert!(index.search_movies("alien", 25, 10).await.unwrap().hits.is_empty());
    }

    #[tokio::test]
    async fn a_reopened_index_keeps_its_documents_and_tombstones() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        apply_ok(&index, &[&review_logged("r1", 100, "Heat", "the diner scene"), &review_deleted("r2", 300)]).await;
        let docs = index.num_docs();
        drop(index);

        let index = open(&dir);
        assert_eq!(index.num_docs(), docs);
        assert_eq!(review_ids(&index, "diner").await, ["r1"]);
        apply_ok(&index, &[&review_logged("r2", 100, "Heat", "the diner again")]).await;
        assert_eq!(review_ids(&index, "diner").await, ["r1"], "the tombstone survived the reopen");
    }

    /// Titles and reviews in Chinese, Japanese, Korean and Thai are found by a word inside them, a
    /// sentence longer than 40 bytes included; the space-separated scripts as before, also after
    /// the index is reopened.
    #[tokio::test]
    async fn text_without_spaces_is_found_by_the_words_inside_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut index = open(&dir);
        apply_ok(
            &index,
            &[
                &movie_discovered("m1", 100, "千と千尋の神隠し", 2001),
                &movie_discovered("m2", 100, "七人の侍", 1954),
                &movie_discovered("m3", 100, "Heat", 1995),
                &review_logged("r1", 100, "千と千尋の神隠し", "何度見ても新しい発見がある。湯婆婆が怖い"),
                &review_logged("r2", 100, "기생충", "반지하 냄새가 잊히지 않는 영화를 봤다"),
                &review_logged("r3", 100, "Heat", "The diner scene, again"),
                &review_logged("r4", 100, "Heat", "หนังเรื่องนี้สนุกมากและดนตรีไพเราะ"),
            ],
        )
        .await;
        for _ in 0..2 {
            assert_eq!(movie_ids(&index, "千尋").await, ["m1"]);
            assert_eq!(movie_ids(&index, "神隠し").await, ["m1"]);
            assert_eq!(movie_ids(&index, "侍").await, ["m2"]);
            assert_eq!(movie_ids(&index, "の").await.len(), 2, "a lone character");
            assert!(movie_ids(&index, "千侍").await.is_empty(), "both characters, side by side");
            assert_eq!(movie_ids(&index, "heat").await, ["m3"]);
            assert_eq!(review_ids(&index, "発見").await, ["r1"], "inside a sentence of 60 bytes");
            assert_eq!(review_ids(&index, "湯婆婆 千尋").await, ["r1"], "the body and the title");
            assert_eq!(review_ids(&index, "영화").await, ["r2"], "a Korean word with its particle");
            assert_eq!(review_ids(&index, "기생충").await, ["r2"]);
            assert_eq!(review_ids(&index, "DINER").await, ["r3"]);
            assert_eq!(review_ids(&index, "ดนตรี").await, ["r4"], "a Thai word inside a sentence of 102 bytes");
            drop(index);
            index = open(&dir);
        }
    }

    /// An index written by the analyzer before (tantivy's default: a run of Chinese, Japanese
    /// or Korean text was one word) keeps finding what it found: a query for such a run also
    /// accepts it as one word.
    #[tokio::test]
    async fn documents_indexed_before_are_found_as_they_were() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("search");
        {
            std::fs::create_dir_all(&path).unwrap();
            let index = Index::create_in_dir(&path, schema()).unwrap();
            let f = Fields::of(&index.schema()).unwrap();
            let mut writer: IndexWriter = index.writer(WRITER_MEMORY_BYTES).unwrap();
            for (key, kind, title, body) in [
                ("movie:m1", KIND_MOVIE, "七人の侍", ""),
                ("review:r1", KIND_REVIEW, "기생충", "BTS의 노래"),
                ("review:r2", KIND_REVIEW, "Amélie", "Un café à Montmartre"),
            ] {
                let mut doc = TantivyDocument::new();
                doc.add_text(f.key, key);
                doc.add_i64(f.version, 100);
                doc.add_bool(f.deleted, false);
                doc.add_text(f.kind, kind);
                doc.add_text(f.movie_id, &key[key.len() - 2..]);
                doc.add_text(f.review_id, &key[key.len() - 2..]);
                doc.add_text(f.title, title);
                doc.add_text(f.body, body);
                writer.add_document(doc).unwrap();
            }
            writer.commit().unwrap();
        }
        let index = SearchIndex::open(&path).unwrap();
        assert_eq!(movie_ids(&index, "七人の侍").await, ["m1"]);
        assert_eq!(review_ids(&index, "기생충").await, ["r1"]);
        assert_eq!(review_ids(&index, "bts의 기생충").await, ["r1"]);
        // Words with accents were held as written, and a query asks for them so too.
        assert_eq!(review_ids(&index, "Amélie café").await, ["r2"]);
        // Found by a word inside it once indexed again; the old document's words stay found.
        apply_ok(&index, &[&movie_discovered("m1", 200, "七人の侍", 1954)]).await;
        assert_eq!(movie_ids(&index, "侍").await, ["m1"]);
        assert_eq!(movie_ids(&index, "七人の侍").await, ["m1"]);
    }

    /// Accents are not needed to find a word, nor typed in one form: "amelie" finds "Amélie",
    /// and a body with a decomposed accent (`e` and U+0301, as pasted text often has it) is
    /// found by the composed word.
    #[tokio::test]
    async fn words_are_found_with_or_without_their_accents() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        apply_ok(&index, &[&review_logged("r1", 100, "Amélie", "Ame\u{0301}lie, a cafe\u{0301} in Montmartre")]).await;
        for asked in ["amelie", "AMÉLIE", "Amélie", "ame\u{0301}lie", "café montmartre", "cafe"] {
            assert_eq!(review_ids(&index, asked).await, ["r1"], "{asked:?}");
        }
        assert!(review_ids(&index, "lie").await.is_empty(), "the accent splits no word");
    }

    #[tokio::test]
    async fn a_batch_answers_per_event() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(&dir);
        let without_id = review_logged("", 100, "Heat", "the diner scene");
        let movie_without_id = event("m1", 100, Payload::MovieDeleted(v1::MovieDeleted::default()));
        let mut no_payload = review_logged("r9", 100, "Heat", "the diner scene");
        no_payload.payload = None;
        let watchlist = event(
            "u1",
            100,
            Payload::WatchlistItemAdded(v1::WatchlistItemAdded { user_id: "u1".into(), movie_id: "m1".into() }),
        );
        let logged = review_logged("r1", 100, "Heat", "the diner scene");

        let results = index.apply(&[&without_id, &no_payload, &watchlist, &logged, &movie_without_id]).await;
        assert!(matches!(&results[0], Err(HandlerError::Permanent(m)) if m.contains("review_id")), "{results:?}");
        assert_eq!(results[1..4], [Ok(()), Ok(()), Ok(())]);
        assert!(matches!(&results[4], Err(HandlerError::Permanent(m)) if m.contains("movie_id")), "{results:?}");
        assert_eq!(review_ids(&index, "diner").await, ["r1"]);
    }

    #[tokio::test]
    async fn a_second_index_on_the_same_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _index = open(&dir);
        let error = SearchIndex::open(dir.path().join("search")).err().expect("the writer lock is held");
        assert!(error.to_string().starts_with("failed to open the search index at "), "{error}");
    }

    #[tokio::test]
    async fn an_enriched_movie_is_found_by_its_director_and_genre() {
        let dir = tempfile::tempdir().unwrap();
        let index = SearchIndex::open(dir.path()).unwrap();
        let discovered = movie_discovered("m1", 100, "Heat", 1995);
        let enriched = movie_enriched("m1", 200, "Heat", 1995, &["Michael Mann"], &["Crime", "Drama"]);
        apply_ok(&index, &[&discovered]).await;
        assert_eq!(index.search_movies("michael mann", 0, 10).await.unwrap().total_hits, 0);
        // Out of order: the older discovery arriving again leaves the enriched document.
        apply_ok(&index, &[&enriched, &discovered]).await;
        let hits = index.search_movies("Michael Mann", 0, 10).await.unwrap();
        assert_eq!(hits.total_hits, 1);
        assert_eq!(hits.hits[0].directors, ["Michael Mann"]);
        assert_eq!(hits.hits[0].genres, ["Crime", "Drama"]);
        // Written before the entries were kept apart by a control character: read as then.
        assert_eq!(
            movie_credits("Michael Mann|Ridley Scott\tCrime|"),
            (vec!["Michael Mann".to_owned(), "Ridley Scott".to_owned()], vec!["Crime".to_owned()])
        );
        assert_eq!(index.search_movies("crime heat", 0, 10).await.unwrap().total_hits, 1);
        assert_eq!(index.search_movies("heat", 0, 10).await.unwrap().hits[0].title, "Heat");
        // The provider no longer knows it: a MovieEnriched without a profile takes the
        // directors and genres away, the film itself stays.
        let mut cleared = movie_enriched("m1", 300, "Heat", 1995, &[], &[]);
        if let Some(v1::event::Payload::MovieEnriched(m)) = cleared.payload.as_mut() {
            m.profile = None;
        }
        apply_ok(&index, &[&cleared]).await;
        assert_eq!(index.search_movies("michael mann", 0, 10).await.unwrap().total_hits, 0);
        assert_eq!(index.search_movies("heat", 0, 10).await.unwrap().total_hits, 1);
    }

    #[tokio::test]
    async fn a_name_holding_a_bar_stays_one_entry() {
        let dir = tempfile::tempdir().unwrap();
        let index = SearchIndex::open(dir.path()).unwrap();
        let enriched = movie_enriched("m1", 200, "Class Relations", 1984, &["Straub|Huillet"], &["Drama|Crime"]);
        apply_ok(&index, &[&enriched]).await;
        let hits = index.search_movies("huillet", 0, 10).await.unwrap();
        assert_eq!(hits.total_hits, 1);
        assert_eq!(hits.hits[0].directors, ["Straub|Huillet"]);
        assert_eq!(hits.hits[0].genres, ["Drama|Crime"]);
    }

    #[tokio::test]
    async fn a_movie_hit_says_which_poster_sizes_are_stored() {
        let dir = tempfile::tempdir().unwrap();
        let index = SearchIndex::open(dir.path()).unwrap();
        let discovered = movie_discovered("m1", 100, "Heat", 1995);
        apply_ok(&index, &[&discovered]).await;
        assert!(index.search_movies("heat", 0, 10).await.unwrap().hits[0].poster_sizes.is_empty());
        let synced = poster_synced("m1", 300);
        let converted = poster_converted("m1", 400, &["w92", "w185"]);
        // In any order, the newer one wins; a later enrichment of the movie keeps them.
        apply_ok(&index, &[&converted, &synced]).await;
        let enriched = movie_enriched("m1", 500, "Heat", 1995, &["Michael Mann"], &[]);
        apply_ok(&index, &[&enriched]).await;
        let hits = index.search_movies("heat", 0, 10).await.unwrap();
        assert_eq!(hits.total_hits, 1, "the posters document is not a movie hit");
        assert_eq!(hits.hits[0].poster_sizes, ["original", "w92", "w185"]);
        // Deleted, its poster sizes go with it: a document of its id written after (only a test
        // makes one) lists none.
        let deleted = event("m1", 600, Payload::MovieDeleted(v1::MovieDeleted { movie_id: "m1".into() }));
        apply_ok(&index, &[&deleted]).await;
        assert_eq!(index.search_movies("heat", 0, 10).await.unwrap().total_hits, 0);
        apply_ok(&index, &[&movie_discovered("m1", 700, "Heat", 1995)]).await;
        assert!(index.search_movies("heat", 0, 10).await.unwrap().hits[0].poster_sizes.is_empty());
    }
}
