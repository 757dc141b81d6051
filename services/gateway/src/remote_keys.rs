//! The public keys of remote signers, fetched from their actor documents and cached.
//!
//! A key id (`https://host/users/alice#main-key`) is fetched without its fragment; the answer is
//! the actor (whose `publicKey` has that id) or the key itself (whose `owner` is then fetched).
//! Nothing a document says about itself is taken on its word: the actor's `id` must be the URL
//! its document was fetched from, and the actor must publish the key (so a document on one
//! server cannot claim to be an actor of another, nor a key claim an owner that does not list
//! it). The actor's inboxes come along, for the follows it sends.
//!
//! A signature's key id is the caller's to choose, and its checks before the fetch (host, date,
//! digest) take no key to pass, so fetching is bounded: a key id whose fetch failed is not
//! fetched again for [`FAILED_FOR`], one fetched is not fetched again within [`MIN_REFETCH`]
//! (a refresh after a failed signature included), and each host is fetched from at most
//! [`FETCHES_PER_HOST`] times a minute. Else any client could have the gateway GET another
//! server's pages as fast as it sends requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reelay_activitypub::client::{FederationClient, FetchError, Outgoing};
use reelay_activitypub::documents::id_of;
use reelay_activitypub::keys::PublicKey;
use serde_json::Value;

/// Keys kept; past this the cache starts over.
const CACHED_KEYS: usize = 10_000;
/// The longest key id, actor id or inbox taken (the write service takes no longer URI). A
/// signer is cached before its signature is checked, so without it anyone could have 10,000
/// actor documents of a megabyte each held here.
const MAX_URI_CHARS: usize = 2048;

/// How long a key id whose fetch failed is answered from memory.
pub const FAILED_FOR: Duration = Duration::from_secs(60);
/// The least time between two fetches of one key id.
pub const MIN_REFETCH: Duration = Duration::from_secs(30);
/// The most fetches from one host in a minute (a server's first contact with many of its
/// actors at once is answered 503 past it, which a sender retries).
pub const FETCHES_PER_HOST: u32 = 60;
/// Hosts (and failed key ids) remembered; past this the memory starts over.
const REMEMBERED: usize = 10_000;

/// A remote signer: its key and who it is.
#[derive(Debug, Clone)]
pub struct RemoteActor {
    pub key: PublicKey,
    pub actor_uri: String,
    pub inbox: Option<String>,
    pub shared_inbox: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyFetchError {
    #[error("cannot fetch the signer's key: {0}")]
    Fetch(FetchError),
    #[error("the signer's key document is unusable: {0}")]
    Invalid(String),
    /// Its fetch failed less than [`FAILED_FOR`] ago: not fetched again yet.
    #[error("fetching the signer's key failed a moment ago: {}", .0.reason)]
    RecentlyFailed(Failure),
    /// Its host was fetched from [`FETCHES_PER_HOST`] times this minute.
    #[error("too many key fetches from {0} this minute; try again later")]
    Throttled(String),
}

/// A key fetch that failed, as remembered for [`FAILED_FOR`].
#[derive(Debug, Clone)]
pub struct Failure {
    pub reason: String,
    /// Whether a later try may pass.
    pub transient: bool,
    /// The URL it found gone (see [`KeyFetchError::gone`]).
    pub gone: Option<String>,
}

impl KeyFetchError {
    /// Whether a later try may pass (the sender is told 503, and retries).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Fetch(error) => error.is_transient(),
            Self::RecentlyFailed(failure) => failure.transient,
            Self::Throttled(_) => true,
            Self::Invalid(_) => false,
        }
    }

    /// The URL the fetch found gone (410 Gone), as requested: the key id's document, or a
    /// document it led to (the key's owner, the id an actor document claims).
    pub fn gone(&self) -> Option<&str> {
        match self {
            Self::Fetch(FetchError::Status { url, status: 410 }) => Some(url),
            Self::RecentlyFailed(failure) => failure.gone.as_deref(),
            _ => None,
        }
    }
}

/// Key id → when it was fetched, and its signer.
type KeyCache = HashMap<String, (Instant, Arc<RemoteActor>)>;

/// What bounds fetching: failed key ids (when, why), and each host's fetches this minute
/// (since when, how many).
#[derive(Default)]
struct Fetches {
    failed: HashMap<String, (Instant, Failure)>,
    per_host: HashMap<String, (Instant, u32)>,
}

#[derive(Clone)]
pub struct RemoteKeys {
    http: FederationClient,
    ttl: Duration,
    cache: Arc<Mutex<KeyCache>>,
    fetches: Arc<Mutex<Fetches>>,
}

impl RemoteKeys {
    pub fn new(http: FederationClient, ttl: Duration) -> Self {
        Self { http, ttl, cache: Arc::default(), fetches: Arc::default() }
    }

    /// The signer of `key_id`, from the cache while fresh unless `refresh` (a signature that
    /// failed with the cached key: the actor may have rotated it; a key fetched less than
    /// [`MIN_REFETCH`] ago is not fetched again).
    pub async fn get(&self, key_id: &str, refresh: bool) -> Result<Arc<RemoteActor>, KeyFetchError> {
        if let Some((at, actor)) = self.cache.lock().expect("key cache lock").get(key_id)
            && at.elapsed() < if refresh { MIN_REFETCH } else { self.ttl }
        {
            return Ok(actor.clone());
        }
        if let Some((at, failure)) = self.fetches.lock().expect("fetches lock").failed.get(key_id)
            && at.elapsed() < FAILED_FOR
        {
            return Err(KeyFetchError::RecentlyFailed(failure.clone()));
        }
        let actor = match self.fetch(key_id).await {
            Ok(actor) => Arc::new(actor),
            // Not remembered: a throttled fetch was never made.
            Err(error @ KeyFetchError::Throttled(_)) => return Err(error),
            Err(error) => {
                let mut fetches = self.fetches.lock().expect("fetches lock");
                if fetches.failed.len() >= REMEMBERED {
                    fetches.failed.clear();
                }
                let failure = Failure {
                    reason: error.to_string(),
                    transient: error.is_transient(),
                    gone: error.gone().map(str::to_owned),
                };
                fetches.failed.insert(key_id.to_owned(), (Instant::now(), failure));
                return Err(error);
            }
        };
        let mut cache = self.cache.lock().expect("key cache lock");
        if cache.len() >= CACHED_KEYS {
            cache.clear();
        }
        cache.insert(key_id.to_owned(), (Instant::now(), actor.clone()));
        Ok(actor)
    }

    /// Counts a fetch from `url`'s host, or refuses it when the host had its share this minute.
    fn may_fetch(&self, url: &str) -> Result<(), KeyFetchError> {
        let host = url::Url::parse(url).ok().and_then(|u| u.host_str().map(str::to_owned)).unwrap_or_default();
        let mut fetches = self.fetches.lock().expect("fetches lock");
        if fetches.per_host.len() >= REMEMBERED {
            fetches.per_host.clear();
        }
        let (since, count) = fetches.per_host.entry(host.clone()).or_insert((Instant::now(), 0));
        if since.elapsed() >= Duration::from_secs(60) {
            (*since, *count) = (Instant::now(), 0);
        }
        if *count >= FETCHES_PER_HOST {
            return Err(KeyFetchError::Throttled(host));
        }
        *count += 1;
        Ok(())
    }

    /// Whether `url` answers 410 Gone now: asked again, not remembered, within its host's share
    /// of fetches.
    pub async fn answers_gone(&self, url: &str) -> bool {
        matches!(self.fetch_document(url).await, Err(KeyFetchError::Fetch(FetchError::Status { status: 410, .. })))
    }

    /// True when a fresh cached key was used (worth a refetch if it fails; a stale one was
    /// fetched again anyway).
    pub fn is_cached(&self, key_id: &str) -> bool {
        self.cache.lock().expect("key cache lock").get(key_id).is_some_and(|(at, _)| at.elapsed() < self.ttl)
    }

    async fn fetch_document(&self, url: &str) -> Result<Value, KeyFetchError> {
        let request = Outgoing::get(url).map_err(KeyFetchError::Fetch)?;
        self.may_fetch(url)?;
        self.http.fetch_json(request).await.map_err(KeyFetchError::Fetch)
    }

    /// The actor `document` fetched from `url`, as its own id's URL serves it: a document may
    /// say it is anyone, so one whose id is not `url` (a key URL that answers with the actor,
    /// as some servers do, or a forgery) is fetched again from its id, which must then match.
    async fn as_itself(&self, url: &str, document: Value) -> Result<Value, KeyFetchError> {
        let id = id_of(&document).ok_or_else(|| invalid("the actor has no id"))?;
        if id == url {
            return Ok(document);
        }
        let own = self.fetch_document(id).await?;
        if id_of(&own) != Some(id) {
            return Err(invalid(format!("the actor document at {url} says it is {id}, whose document does not")));
        }
        Ok(own)
    }

    async fn fetch(&self, key_id: &str) -> Result<RemoteActor, KeyFetchError> {
        bounded("key id", key_id)?;
        let document_url = key_document(key_id);
        let document = self.fetch_document(document_url).await?;
        let (actor, key) = if document.get("publicKeyPem").is_some() {
            // The key itself: its owner is the actor, which must publish it too (else any key
            // could name anyone as its owner).
            if id_of(&document) != Some(key_id) {
                return Err(invalid("the key document's id is not the key id"));
            }
            let owner = document.get("owner").and_then(Value::as_str).ok_or_else(|| invalid("the key has no owner"))?;
            let fetched = self.fetch_document(owner).await?;
            let actor = self.as_itself(owner, fetched).await?;
            let published =
                published_key(&actor, key_id).ok_or_else(|| invalid("the key's owner does not publish that key"))?;
            // The owner's copy of the key counts, when it carries the PEM.
            (actor, if published.get("publicKeyPem").is_some() { published } else { document })
        } else {
            let actor = self.as_itself(document_url, document).await?;
            let key = published_key(&actor, key_id).ok_or_else(|| invalid("the actor does not publish that key"))?;
            (actor, key)
        };
        let actor_uri = bounded("id", id_of(&actor).ok_or_else(|| invalid("the actor has no id"))?)?.to_owned();
        if key.get("owner").and_then(Value::as_str) != Some(actor_uri.as_str()) {
            return Err(invalid("the key's owner is not the actor that publishes it"));
        }
        let pem = key.get("publicKeyPem").and_then(Value::as_str).ok_or_else(|| invalid("the key has no PEM"))?;
        let key = PublicKey::from_pem(pem).map_err(|e| invalid(e.to_string()))?;
        let text = |what, v: Option<&Value>| {
            v.and_then(Value::as_str).map(|uri| bounded(what, uri).map(str::to_owned)).transpose()
        };
        Ok(RemoteActor {
            key,
            inbox: text("inbox", actor.get("inbox"))?,
            shared_inbox: text("sharedInbox", actor.get("endpoints").and_then(|e| e.get("sharedInbox")))?,
            actor_uri,
        })
    }
}

/// The key `key_id` among those `actor` publishes (`publicKey`: one, or a list).
fn published_key(actor: &Value, key_id: &str) -> Option<Value> {
    match actor.get("publicKey")? {
        Value::Array(keys) => keys.iter().find(|key| id_of(key) == Some(key_id)).cloned(),
        key => (id_of(key) == Some(key_id)).then(|| key.clone()),
    }
}

/// `uri` (the signer's `what`) if it is no longer than [`MAX_URI_CHARS`].
fn bounded<'a>(what: &str, uri: &'a str) -> Result<&'a str, KeyFetchError> {
    if uri.len() > MAX_URI_CHARS {
        return Err(invalid(format!("the signer's {what} is longer than {MAX_URI_CHARS} characters")));
    }
    Ok(uri)
}

fn invalid(reason: impl Into<String>) -> KeyFetchError {
    KeyFetchError::Invalid(reason.into())
}

/// The document a key id names: the id without its fragment (`…/users/a#main-key`).
pub(crate) fn key_document(key_id: &str) -> &str {
    key_id.split_once('#').map_or(key_id, |(document, _)| document)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key id longer than any URI taken is refused before anything is fetched (port 1 on
    /// loopback would only refuse the connection).
    #[tokio::test]
    async fn a_key_id_too_long_is_refused_unfetched() {
        let http = FederationClient::new(Duration::from_secs(5), 1024, true).unwrap();
        let keys = RemoteKeys::new(http, Duration::from_secs(60));
        let key_id = format!("http://127.0.0.1:1/users/{}#main-key", "a".repeat(MAX_URI_CHARS));
        let error = keys.get(&key_id, false).await.unwrap_err();
        assert!(matches!(&error, KeyFetchError::Invalid(reason) if reason.contains("key id")), "{error}");
        assert!(!keys.is_cached(&key_id));
        let short = "http://127.0.0.1:1/users/alice#main-key";
        assert!(matches!(keys.get(short, false).await, Err(KeyFetchError::Fetch(_))), "a short one is fetched");
    }

    /// A loopback server answering every request 404, counting them; its base URL.
    async fn answering_404() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = count.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    let mut buffer = [0; 4096];
                    let _ = stream.read(&mut buffer).await;
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let _ = stream
                        .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                        .await;
                });
            }
        });
        (base, count)
    }

    /// Fetching is bounded (the key id is the caller's to choose): a key id that failed is not
    /// fetched again for a while, and past its share a host is not fetched from this minute,
    /// which the inbox answers 503 (a retry may pass), unlike a 404 (401).
    #[tokio::test]
    async fn failed_key_ids_and_busy_hosts_are_not_fetched_again() {
        use std::sync::atomic::Ordering;
        let (base, requests) = answering_404().await;
        let http = FederationClient::new(Duration::from_secs(5), 1024, true).unwrap();
        let keys = RemoteKeys::new(http, Duration::from_secs(60));
        let key_id = |n: u32| format!("{base}/users/u{n}#main-key");
        let first = keys.get(&key_id(0), false).await.unwrap_err();
        assert!(matches!(first, KeyFetchError::Fetch(_)) && !first.is_transient(), "{first}");
        let again = keys.get(&key_id(0), true).await.unwrap_err();
        assert!(matches!(&again, KeyFetchError::RecentlyFailed(f) if !f.transient), "{again}");
        assert_eq!(requests.load(Ordering::SeqCst), 1, "not fetched again");
        for n in 1..FETCHES_PER_HOST {
            assert!(matches!(keys.get(&key_id(n), false).await, Err(KeyFetchError::Fetch(_))), "{n}");
        }
        let throttled = keys.get(&key_id(FETCHES_PER_HOST), false).await.unwrap_err();
        assert!(matches!(throttled, KeyFetchError::Throttled(_)) && throttled.is_transient(), "{throttled}");
        assert_eq!(requests.load(Ordering::SeqCst), FETCHES_PER_HOST as usize);
    }
}
