//! Object storage for the handlers that store files (wrap-up cards, posters): one setting for
//! all of them. By default the local filesystem under the data dir, so `reelay run` needs
//! nothing else; or any S3-compatible store, by URL (`s3://bucket/prefix`) with an endpoint and
//! credentials. Writes are atomic: an object is either wholly there or not at all.
//!
//! It also has the media route, which serves stored objects over HTTP with their content type
//! and caching headers.

use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use futures_util::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

mod media;

pub use media::media_router;

/// The longest key taken (Reelay's own are under 100 bytes).
pub const MAX_KEY_BYTES: usize = 1024;

/// The longest segment of a key taken: a file name's limit on Linux.
pub const MAX_SEGMENT_BYTES: usize = 255;

/// Where objects are stored.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ObjectsSettings {
    /// Where handlers store files: a directory (`file:///srv/reelay/objects` or a plain path) or
    /// an S3 bucket (`s3://bucket/prefix`). Defaults to `<data-dir>/objects`.
    #[arg(id = "objects_url", long = "objects-url", env = "REELAY_OBJECTS_URL")]
    pub url: Option<String>,
    /// The endpoint of an S3-compatible server (`http://127.0.0.1:9000`); unset for AWS itself.
    #[arg(id = "objects_s3_endpoint", long = "objects-s3-endpoint", env = "REELAY_OBJECTS_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    #[arg(
        id = "objects_s3_region",
        long = "objects-s3-region",
        env = "REELAY_OBJECTS_S3_REGION",
        default_value = "us-east-1"
    )]
    pub s3_region: String,
    #[arg(
        id = "objects_s3_access_key_id",
        long = "objects-s3-access-key-id",
        env = "REELAY_OBJECTS_S3_ACCESS_KEY_ID",
        hide_env_values = true
    )]
    pub s3_access_key_id: Option<String>,
    #[arg(
        id = "objects_s3_secret_access_key",
        long = "objects-s3-secret-access-key",
        env = "REELAY_OBJECTS_S3_SECRET_ACCESS_KEY",
        hide_env_values = true
    )]
    pub s3_secret_access_key: Option<String>,
}

/// Why an object operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ObjectsError {
    /// Not a key of this store: empty, or a segment that is empty, `.` or `..`.
    #[error("not an object key: {key:?}: {reason}")]
    BadKey { key: String, reason: String },
    #[error("object storage ({store}): {source}")]
    Store {
        store: String,
        #[source]
        source: object_store::Error,
    },
    #[error("object storage: cannot sync the directory {path} after a delete: {source}")]
    Sync {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How long an S3 call retries, and how long one request may take.
const S3_RETRY_FOR: Duration = Duration::from_secs(20);

/// Errors of a local store's disk that every write meets alike until an operator acts: EIO,
/// ENOSPC, EROFS, EDQUOT (Linux's numbers).
const DISK_DOWN: [i32; 4] = [5, 28, 30, 122];

impl ObjectsError {
    /// Whether the store itself is down, as it would be for any key, not this key or this
    /// request: it cannot be reached or did not answer in time (after the client's own
    /// retries), or the disk of a local store is full or failing. An answer about the request
    /// (a 4xx, a path that cannot be made) is not.
    pub fn store_unavailable(&self) -> bool {
        use object_store::client::{HttpError, HttpErrorKind};
        let mut cause: Option<&(dyn std::error::Error + 'static)> = match self {
            Self::BadKey { .. } => return false,
            Self::Store { source, .. } => Some(source),
            Self::Sync { source, .. } => Some(source),
        };
        while let Some(error) = cause {
            if let Some(http) = error.downcast_ref::<HttpError>() {
                let kind = http.kind();
                return matches!(kind, HttpErrorKind::Connect | HttpErrorKind::Timeout | HttpErrorKind::Interrupted);
            }
            if let Some(io) = error.downcast_ref::<std::io::Error>() {
                return io.raw_os_error().is_some_and(|code| DISK_DOWN.contains(&code));
            }
            cause = error.source();
        }
        false
    }
}

/// A handle on the object store. Cheap to clone.
#[derive(Clone)]
pub struct Objects {
    store: Arc<dyn ObjectStore>,
    /// The directory of a store on the local filesystem (its deletes are synced here).
    local_dir: Option<Arc<std::path::PathBuf>>,
    /// Where it is, for logs and errors.
    describe: Arc<str>,
}

impl std::fmt::Debug for Objects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Objects").field("store", &self.describe).finish()
    }
}

/// An object being read: what the store says of it before its bytes, then its bytes as they
/// come (a large one is never held whole).
pub struct Reading {
    pub size: u64,
    /// When it was last written (for `Last-Modified`).
    pub modified: std::time::SystemTime,
    /// The store's tag for this version (for `ETag`), when it has one.
    pub e_tag: Option<String>,
    pub bytes: futures_util::stream::BoxStream<'static, Result<Bytes, ObjectsError>>,
}

impl Objects {
    /// Opens the store the settings name (creating the local directory if needed).
    pub fn open(settings: &ObjectsSettings, data_dir: &FsPath) -> anyhow::Result<Self> {
        let url = settings.url.clone().unwrap_or_default();
        if let Some(rest) = url.strip_prefix("s3://") {
            install_tls_provider();
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                bail!("REELAY_OBJECTS_URL {url:?} names no bucket (s3://bucket/prefix)");
            }
            let mut builder =
                object_store::aws::AmazonS3Builder::new().with_bucket_name(bucket).with_region(&settings.s3_region);
            // A store that does not answer is known within about 25 s (the client's default
            // tries for 3 minutes): inside a handler's timeout (60 s by default), so the handler
            // says its store is down (its events held, no attempt spent) rather than timing out
            // (an attempt spent), and a media request is answered 503 while its client waits.
            let retry = object_store::RetryConfig { max_retries: 3, retry_timeout: S3_RETRY_FOR, ..Default::default() };
            let options = object_store::ClientOptions::new()
                .with_connect_timeout(Duration::from_secs(5))
                .with_timeout(S3_RETRY_FOR);
            // Before the endpoint: the client options hold its allow-http.
            builder = builder.with_retry(retry).with_client_options(options);
            if let Some(endpoint) = &settings.s3_endpoint {
                builder = builder.with_endpoint(endpoint).with_allow_http(endpoint.starts_with("http://"));
            }
            if let (Some(id), Some(secret)) = (&settings.s3_access_key_id, &settings.s3_secret_access_key) {
                builder = builder.with_access_key_id(id).with_secret_access_key(secret);
            }
            let s3 = builder.build().with_context(|| format!("cannot use the S3 store {url:?}"))?;
            let store: Arc<dyn ObjectStore> = if prefix.trim_matches('/').is_empty() {
                Arc::new(s3)
            } else {
                Arc::new(object_store::prefix::PrefixStore::new(s3, prefix.trim_matches('/')))
            };
            return Ok(Self { store, local_dir: None, describe: Arc::from(url.as_str()) });
        }
        let dir = match url.strip_prefix("file://") {
            Some(path) => FsPath::new(path).to_owned(),
            None if url.is_empty() => data_dir.join("objects"),
            None if url.contains("://") => {
                bail!("REELAY_OBJECTS_URL {url:?}: expected a directory or s3://bucket/prefix")
            }
            None => FsPath::new(&url).to_owned(),
        };
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create the objects directory {}", dir.display()))?;
        let local = object_store::local::LocalFileSystem::new_with_prefix(&dir)
            .with_context(|| format!("cannot use the objects directory {}", dir.display()))?
            .with_automatic_cleanup(true)
            // Synced before a put returns, as S3 does: a handler records what it stored (a
            // wrap-up's card, a poster's variants) once the put returns, and the write service
            // commits that record with an fsync; an object left in the page cache alone could be
            // missing or empty after a power cut while the record points at it.
            .with_fsync(true);
        let describe = Arc::from(format!("file://{}", dir.display()).as_str());
        Ok(Self { store: Arc::new(local), local_dir: Some(Arc::new(dir)), describe })
    }

    fn error(&self, source: object_store::Error) -> ObjectsError {
        ObjectsError::Store { store: self.describe.to_string(), source }
    }

    /// The store's path of a key; keys never climb out of the store, and are ones every store
    /// can hold: at most [`MAX_KEY_BYTES`], segments of at most [`MAX_SEGMENT_BYTES`] (a file
    /// name's limit), no name of a staging file (`<name>#<digits>`, which the local store
    /// refuses). The media route takes keys from any URL, so these are a caller's mistakes
    /// (400), not the store failing (503).
    fn path(key: &str) -> Result<Path, ObjectsError> {
        let bad = |reason: String| ObjectsError::BadKey { key: key.to_owned(), reason };
        if key.is_empty() {
            return Err(bad("empty".into()));
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(bad(format!("longer than {MAX_KEY_BYTES} bytes")));
        }
        let path = Path::parse(key).map_err(|e| bad(e.to_string()))?;
        if path.parts().any(|part| part.as_ref().len() > MAX_SEGMENT_BYTES) {
            return Err(bad(format!("a segment is longer than {MAX_SEGMENT_BYTES} bytes")));
        }
        if path.filename().is_some_and(|name| is_staging_name(std::ffi::OsStr::new(name))) {
            return Err(bad("a name ending in # and digits is a staging file's".into()));
        }
        Ok(path)
    }

    /// Whether `error` is the local store's answer to a key that runs through a file
    /// (`cards/x/card.svg/more`): no such object, not a failing store.
    fn through_a_file(&self, error: &object_store::Error) -> bool {
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            if cause.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::NotADirectory) {
                return self.local_dir.is_some();
            }
            source = cause.source();
        }
        false
    }

    /// Writes `bytes` under `key`, atomically (a reader sees the whole object or none).
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<(), ObjectsError> {
        let path = Self::path(key)?;
        self.store.put(&path, PutPayload::from(bytes)).await.map_err(|e| self.error(e))?;
        Ok(())
    }

    /// The bytes of the object under `key`, or `None` when there is none.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, ObjectsError> {
        let Some(result) = self.get_result(key).await? else { return Ok(None) };
        Ok(Some(result.bytes().await.map_err(|e| self.error(e))?))
    }

    /// The object under `key` as it is read, or `None` when there is none.
    pub async fn read(&self, key: &str) -> Result<Option<Reading>, ObjectsError> {
        use futures_util::{StreamExt, TryStreamExt};
        let Some(result) = self.get_result(key).await? else { return Ok(None) };
        let meta = result.meta.clone();
        let store = self.clone();
        Ok(Some(Reading {
            size: meta.size,
            modified: meta.last_modified.into(),
            e_tag: meta.e_tag,
            bytes: result.into_stream().map_err(move |e| store.error(e)).boxed(),
        }))
    }

    async fn get_result(&self, key: &str) -> Result<Option<object_store::GetResult>, ObjectsError> {
        match self.store.get(&Self::path(key)?).await {
            Ok(result) => Ok(Some(result)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(error) if self.through_a_file(&error) => Ok(None),
            Err(error) => Err(self.error(error)),
        }
    }

    /// Whether an object exists under `key`.
    pub async fn exists(&self, key: &str) -> Result<bool, ObjectsError> {
        let path = Self::path(key)?;
        match self.store.head(&path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(error) if self.through_a_file(&error) => Ok(false),
            Err(error) => Err(self.error(error)),
        }
    }

    /// The keys under `prefix` (a folder: `posters/<movie id>`).
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, ObjectsError> {
        let path = Self::path(prefix)?;
        let metas: Vec<_> = self.store.list(Some(&path)).try_collect().await.map_err(|e| self.error(e))?;
        Ok(metas.into_iter().map(|m| m.location.to_string()).collect())
    }

    /// Deletes every object under `prefix`; one already gone counts as deleted. Returns how many
    /// were deleted.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<usize, ObjectsError> {
        let keys = self.list(prefix).await?;
        for key in &keys {
            self.unlink(key).await?;
        }
        self.sync_deletes(&keys).await?;
        Ok(keys.len())
    }

    /// Deletes `key`; a key that is not there counts as deleted. On the local filesystem the
    /// delete is synced before this returns, as a put is.
    pub async fn delete(&self, key: &str) -> Result<(), ObjectsError> {
        self.unlink(key).await?;
        self.sync_deletes(&[key]).await
    }

    /// Deletes `key` without syncing; a key that is not there counts as deleted.
    async fn unlink(&self, key: &str) -> Result<(), ObjectsError> {
        match self.store.delete(&Self::path(key)?).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(error) => Err(self.error(error)),
        }
    }

    /// Syncs each directory that held one of `keys` (or, where the empty directory was removed
    /// with it, the nearest one left), once, so the unlinks are on disk before the caller
    /// records the delete: object_store syncs puts but not deletes, and a power cut could
    /// otherwise bring back a deleted movie's posters. A key already gone is synced too: its
    /// delete may be a retry of one whose sync failed.
    async fn sync_deletes(&self, keys: &[impl AsRef<str>]) -> Result<(), ObjectsError> {
        let Some(root) = self.local_dir.clone() else { return Ok(()) };
        let mut dirs: Vec<std::path::PathBuf> =
            keys.iter().filter_map(|k| root.join(k.as_ref()).parent().map(Into::into)).collect();
        dirs.sort();
        dirs.dedup();
        let synced = tokio::task::spawn_blocking(move || {
            for mut dir in dirs {
                while !dir.is_dir() && dir.starts_with(&*root) && dir != *root {
                    dir.pop();
                }
                std::fs::File::open(&dir)
                    .and_then(|d| d.sync_all())
                    .map_err(|source| ObjectsError::Sync { path: dir, source })?;
            }
            Ok(())
        })
        .await;
        synced
            .unwrap_or_else(|e| Err(ObjectsError::Sync { path: Default::default(), source: std::io::Error::other(e) }))
    }

    /// Where the store is, for logs.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// On the local filesystem, removes the staging files of puts that never finished, now and
    /// every [`STAGING_SWEEP_EVERY`] while the runtime lives (see [`remove_stale_staging`]).
    /// Does nothing for S3, which keeps no partial object.
    pub fn spawn_staging_sweeper(&self) {
        let Some(root) = self.local_dir.clone() else { return };
        tokio::spawn(async move {
            loop {
                let swept = {
                    let root = root.clone();
                    tokio::task::spawn_blocking(move || remove_stale_staging(&root, STAGING_ORPHAN_AGE)).await
                };
                match swept {
                    Ok(Ok(0)) => {}
                    Ok(Ok(removed)) => tracing::info!(
                        removed,
                        dir = %root.display(),
                        "removed the staging files of object writes that never finished"
                    ),
                    Ok(Err(error)) => tracing::warn!(%error, dir = %root.display(), "cannot sweep staging files"),
                    Err(error) => tracing::warn!(%error, "the staging sweep stopped"),
                }
                tokio::time::sleep(STAGING_SWEEP_EVERY).await;
            }
        });
    }
}

/// How old a staging file must be to count as left by a dead put: a put runs inside one
/// handler call, which its timeout (a minute by default) ends long before this.
pub const STAGING_ORPHAN_AGE: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// How often the staging sweep walks the store.
pub const STAGING_SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

/// Whether `name` is a staging file's: object_store writes a put to `<key>#<n>` and renames it
/// into place, and never lists such names (a key's own `#` is followed by something else).
fn is_staging_name(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    name.rsplit_once('#')
        .is_some_and(|(key, n)| !key.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the staging files under `root` last written more than `older_than` ago, and returns
/// how many. A process killed in the middle of a put leaves one (`posters/<id>/original#1`);
/// nothing lists or deletes it afterwards, not even the delete of its folder. Symbolic links
/// are not followed; a file that vanishes meanwhile is skipped.
pub fn remove_stale_staging(root: &FsPath, older_than: std::time::Duration) -> std::io::Result<usize> {
    let mut removed = 0;
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound && dir != root => continue,
            Err(error) => return Err(error),
        };
        let mut removed_here = false;
        for entry in entries {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                dirs.push(entry.path());
                continue;
            }
            if !kind.is_file() || !is_staging_name(&entry.file_name()) {
                continue;
            }
            let age = match entry.metadata().and_then(|m| m.modified()) {
                Ok(modified) => modified.elapsed().unwrap_or_default(),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) => return Err(error),
            };
            if age < older_than {
                continue;
            }
            match std::fs::remove_file(entry.path()) {
                Ok(()) => {
                    tracing::debug!(path = %entry.path().display(), "removed a stale staging file");
                    removed += 1;
                    removed_here = true;
                }
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(error),
            }
        }
        if removed_here {
            std::fs::File::open(&dir)?.sync_all()?;
        }
    }
    Ok(removed)
}

/// rustls needs a crypto provider for HTTPS to S3; Reelay uses ring (already its crypto). A
/// second installation (another caller got there first) changes nothing.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the store being down says so: unreachable (a real S3 client against a port nobody
    /// listens on), or a local disk full or failing; not an answer about the key or request.
    #[tokio::test]
    async fn a_store_is_unavailable_when_unreachable_or_its_disk_fails() {
        let generic = |code: i32| ObjectsError::Store {
            store: "file:///x".into(),
            source: object_store::Error::Generic {
                store: "LocalFileSystem",
                source: Box::new(std::io::Error::from_raw_os_error(code)),
            },
        };
        assert!(generic(28).store_unavailable(), "ENOSPC");
        assert!(generic(5).store_unavailable(), "EIO");
        assert!(!generic(13).store_unavailable(), "EACCES: this path's");
        assert!(!generic(20).store_unavailable(), "ENOTDIR: this path's");
        let sync = ObjectsError::Sync { path: "/x".into(), source: std::io::Error::from_raw_os_error(5) };
        assert!(sync.store_unavailable());
        assert!(!ObjectsError::BadKey { key: "".into(), reason: "empty".into() }.store_unavailable());
        let missing = object_store::Error::NotFound { path: "k".into(), source: "gone".into() };
        assert!(!ObjectsError::Store { store: "s3://b".into(), source: missing }.store_unavailable());

        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let settings = ObjectsSettings {
            url: Some("s3://bucket".into()),
            s3_endpoint: Some(endpoint),
            s3_access_key_id: Some("id".into()),
            s3_secret_access_key: Some("secret".into()),
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let objects = Objects::open(&settings, dir.path()).unwrap();
        let error = objects.get("posters/m1/original").await.unwrap_err();
        assert!(error.store_unavailable(), "{error:?}");
    }

    #[tokio::test]
    async fn local_store_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let objects = Objects::open(&ObjectsSettings::default(), dir.path()).unwrap();
        objects.put("posters/m1/original", Bytes::from_static(b"one")).await.unwrap();
        objects.put("posters/m1/w92.webp", Bytes::from_static(b"two")).await.unwrap();
        objects.put("posters/m2/original", Bytes::from_static(b"three")).await.unwrap();
        assert!(objects.exists("posters/m1/original").await.unwrap());
        assert!(!objects.exists("posters/m3/original").await.unwrap());
        assert_eq!(objects.get("posters/m2/original").await.unwrap().unwrap(), Bytes::from_static(b"three"));
        assert!(objects.get("nothing/here").await.unwrap().is_none());
        let mut keys = objects.list("posters/m1").await.unwrap();
        keys.sort();
        assert_eq!(keys, ["posters/m1/original", "posters/m1/w92.webp"]);
        assert_eq!(objects.delete_prefix("posters/m1").await.unwrap(), 2);
        assert_eq!(objects.delete_prefix("posters/m1").await.unwrap(), 0, "deleting again is a no-op");
        assert!(objects.exists("posters/m2/original").await.unwrap());
        assert!(dir.path().join("objects/posters/m2/original").exists(), "under the data dir by default");
    }

    /// A put's staging file left by a killed process goes once it is old enough; a young one
    /// (a put in flight, maybe in another process sharing the directory) stays, and so do keys
    /// whose own name holds a `#`.
    #[tokio::test]
    async fn stale_staging_files_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let objects = Objects::open(&ObjectsSettings::default(), dir.path()).unwrap();
        objects.put("posters/m1/original", Bytes::from_static(b"kept")).await.unwrap();
        objects.put("cards/a#b", Bytes::from_static(b"a key with a hash")).await.unwrap();
        let root = dir.path().join("objects");
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        let stale = [root.join("posters/m1/original#1"), root.join("posters/m2/w92.webp#12")];
        let young = root.join("posters/m1/w185.webp#1");
        for (path, old) in stale.iter().map(|p| (p, true)).chain([(&young, false)]) {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let file = std::fs::File::create(path).unwrap();
            if old {
                file.set_modified(hour_ago).unwrap();
            }
        }
        let old_key = root.join("cards/a#b");
        std::fs::File::options().write(true).open(&old_key).unwrap().set_modified(hour_ago).unwrap();

        assert_eq!(remove_stale_staging(&root, STAGING_ORPHAN_AGE).unwrap(), 2);
        for path in &stale {
            assert!(!path.exists(), "{} removed", path.display());
        }
        assert!(young.exists(), "a put in flight keeps its staging file");
        assert_eq!(objects.get("cards/a#b").await.unwrap().unwrap(), Bytes::from_static(b"a key with a hash"));
        assert_eq!(objects.get("posters/m1/original").await.unwrap().unwrap(), Bytes::from_static(b"kept"));
        assert_eq!(remove_stale_staging(&root, STAGING_ORPHAN_AGE).unwrap(), 0, "nothing more");
    }

    /// Keys a URL can name that no store holds are a caller's mistake, and a key running
    /// through a file names nothing; neither is the store failing (the media route answers
    /// 400 and 404, not 503).
    #[tokio::test]
    async fn keys_no_store_holds_are_refused_and_paths_through_files_are_missing() {
        let dir = tempfile::tempdir().unwrap();
        let objects = Objects::open(&ObjectsSettings::default(), dir.path()).unwrap();
        objects.put("wrapups/x/card.svg", Bytes::from_static(b"<svg/>")).await.unwrap();
        let long_segment = format!("wrapups/{}", "x".repeat(MAX_SEGMENT_BYTES + 1));
        let long_key = "x/".repeat(MAX_KEY_BYTES);
        for key in ["a#1", "posters/m/original#12", long_segment.as_str(), long_key.as_str()] {
            assert!(matches!(objects.get(key).await, Err(ObjectsError::BadKey { .. })), "{key}");
        }
        assert!(objects.get("wrapups/x/card.svg/more").await.unwrap().is_none());
        assert!(!objects.exists("wrapups/x/card.svg/more").await.unwrap());
        assert!(objects.get("a#b").await.unwrap().is_none(), "a # followed by letters is a name");
    }

    #[test]
    fn bad_urls_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for url in ["s3://", "ftp://host/x"] {
            let settings = ObjectsSettings { url: Some(url.into()), ..Default::default() };
            assert!(Objects::open(&settings, dir.path()).is_err(), "{url}");
        }
    }
}
