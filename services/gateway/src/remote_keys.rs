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
//! server's pages as fast as it sends requests. Every URL fetched (the key id's, a key's owner,
//! the id an actor document claims) is at most [`MAX_URI_CHARS`] long, and a failure is kept as
//! a short reason, so what a failed fetch leaves in memory is small whatever a document says.
//!
//! Since anyone can spend a host's share with key ids of their choosing, a key id already cached
//! is fetched again outside that share (its own refetches are bounded: once per time to live,
//! or per [`MIN_REFETCH`] after a failed signature, or per [`FAILED_FOR`] after a failed fetch);
//! only documents on its own host are, not an owner or id it leads to elsewhere.
//! And while its server cannot be asked (unreachable, failing, busy), the key it published last
//! stands in for up to [`STAND_IN_FOR`] past [`RemoteKeys::new`]'s time to live, rather than its
//! signed requests refused until the fetch passes; a signature that fails with a stand-in is
//! answered 503 (the real key may be fetched on the sender's retry). The cache starts over only
//! when full, first dropping what is past its time to live (stand-ins too), then the half least
//! recently used.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reelay_activitypub::client::{FederationClient, FetchError, Outgoing};
use reelay_activitypub::documents::id_of;
use reelay_activitypub::keys::PublicKey;
use serde_json::Value;

/// Keys kept; past this the cache drops the stale and the least recently used.
const CACHED_KEYS: usize = 10_000;
/// The longest failure reason remembered (a fetch error names its URL; see [`MAX_URI_CHARS`]).
const MAX_REASON_CHARS: usize = 512;
/// The longest key id, actor id or inbox taken (the write service takes no longer URI). A
/// signer is cached before its signature is checked, so without it anyone could have 10,000
/// actor documents of a megabyte each held here.
const MAX_URI_CHARS: usize = 2048;

/// How long a key id whose fetch failed is answered from memory.
pub const FAILED_FOR: Duration = Duration::from_secs(60);
/// The least time between two fetches of one key id.
pub const MIN_REFETCH: Duration = Duration::from_secs(30);
/// How long past its time to live a cached key stands in while its server cannot be asked.
pub const STAND_IN_FOR: Duration = Duration::from_secs(3 * 86_400);
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

/// A signer's key as [`RemoteKeys::get`] has it.
#[derive(Debug, Clone)]
pub struct SignerKey {
    pub actor: Arc<RemoteActor>,
    pub source: KeySource,
}

/// Where [`RemoteKeys::get`] had a key from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// The cache, within its time to live: worth a refetch if a signature fails with it.
    Cached,
    /// Its document, now.
    Fetched,
    /// The cache past its time to live, standing in while its server cannot be asked (see the
    /// module's comment): a signature that fails with it may pass with the key fetched later.
    StandIn,
}

/// A fetched signer: when it was fetched and last used.
struct Cached {
    fetched: Instant,
    used: Instant,
    actor: Arc<RemoteActor>,
}

/// Key id → its signer.
type KeyCache = HashMap<String, Cached>;

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
    ///
    /// A cached signer past its time to live is fetched again, and still used when that fetch
    /// fails in a way a later one may pass (see the module's comment).
    pub async fn get(&self, key_id: &str, refresh: bool) -> Result<SignerKey, KeyFetchError> {
        let cached = {
            let mut cache = self.cache.lock().expect("key cache lock");
            cache.get_mut(key_id).map(|entry| {
                entry.used = Instant::now();
                (entry.fetched, entry.actor.clone())
            })
        };
        let fresh_for = if refresh { MIN_REFETCH } else { self.ttl };
        let stand_in = match &cached {
            Some((fetched, actor)) if fetched.elapsed() < fresh_for => {
                return Ok(SignerKey { actor: actor.clone(), source: KeySource::Cached });
            }
            // After a failed signature, the cached key is the one that failed: no stand-in.
            Some((fetched, actor)) if !refresh && fetched.elapsed() < self.ttl + STAND_IN_FOR => Some(actor.clone()),
            _ => None,
        };
        match (self.fetch_and_keep(key_id, cached.is_some()).await, stand_in) {
            (Ok(actor), _) => Ok(SignerKey { actor, source: KeySource::Fetched }),
            (Err(error), Some(actor)) if error.is_transient() => {
                tracing::info!(key_id, %error, "the signer's key cannot be fetched again now; the one fetched before stands in");
                Ok(SignerKey { actor, source: KeySource::StandIn })
            }
            (Err(error), _) => Err(error),
        }
    }

    /// Fetches the signer of `key_id` (unless its fetch failed a moment ago) and caches it;
    /// `known`: it is cached already, and fetched outside its host's share.
    async fn fetch_and_keep(&self, key_id: &str, known: bool) -> Result<Arc<RemoteActor>, KeyFetchError> {
        if let Some((at, failure)) = self.fetches.lock().expect("fetches lock").failed.get(key_id)
            && at.elapsed() < FAILED_FOR
        {
            return Err(KeyFetchError::RecentlyFailed(failure.clone()));
        }
        let actor = match self.fetch(key_id, known).await {
            Ok(actor) => Arc::new(actor),
            // Not remembered: a throttled fetch was never made.
            Err(error @ KeyFetchError::Throttled(_)) => return Err(error),
            Err(error) => {
                let mut fetches = self.fetches.lock().expect("fetches lock");
                if fetches.failed.len() >= REMEMBERED {
                    // Only what is past its time goes: clearing all would let whoever fills
                    // the map (key ids that never resolve) have every failed fetch made again.
                    fetches.failed.retain(|_, (at, _)| at.elapsed() < FAILED_FOR);
                }
                if fetches.failed.len() >= REMEMBERED {
                    // Full of failures this minute: this one is not remembered (its host's
                    // share of fetches still bounds how often it is tried).
                    return Err(error);
                }
                let failure = Failure {
                    reason: error.to_string().chars().take(MAX_REASON_CHARS).collect(),
                    transient: error.is_transient(),
                    gone: error.gone().map(str::to_owned),
                };
                fetches.failed.insert(key_id.to_owned(), (Instant::now(), failure));
                return Err(error);
            }
        };
        let mut cache = self.cache.lock().expect("key cache lock");
        if cache.len() >= CACHED_KEYS {
            make_room(&mut cache, self.ttl);
        }
        let now = Instant::now();
        cache.insert(key_id.to_owned(), Cached { fetched: now, used: now, actor: actor.clone() });
        Ok(actor)
    }

    /// Counts a fetch from `url`'s host, or refuses it when the host had its share this minute.
    fn may_fetch(&self, url: &str) -> Result<(), KeyFetchError> {
        let host = host_of(url).unwrap_or_default();
        let mut fetches = self.fetches.lock().expect("fetches lock");
        if fetches.per_host.len() >= REMEMBERED && !fetches.per_host.contains_key(&host) {
            // Only the hosts whose minute is over go: clearing all would give every host its
            // share again to whoever fills the map with hosts of its own.
            fetches.per_host.retain(|_, (since, _)| since.elapsed() < Duration::from_secs(60));
            if fetches.per_host.len() >= REMEMBERED {
                // As many hosts fetched from this minute as are counted: a new one waits.
                return Err(KeyFetchError::Throttled(host));
            }
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
        let fetched = self.fetch_document(url, None).await;
        matches!(fetched, Err(KeyFetchError::Fetch(FetchError::Status { status: 410, .. })))
    }

    /// Fetches `url`, within its host's share unless that host is `exempt` (a cached key id's:
    /// see the module's comment; a document it leads to on another host counts there).
    async fn fetch_document(&self, url: &str, exempt: Option<&str>) -> Result<Value, KeyFetchError> {
        bounded("document URL", url)?;
        let request = Outgoing::get(url).map_err(KeyFetchError::Fetch)?;
        if exempt.is_none() || exempt != host_of(url).as_deref() {
            self.may_fetch(url)?;
        }
        self.http.fetch_json(request).await.map_err(KeyFetchError::Fetch)
    }

    /// The actor `document` fetched from `url`, as its own id's URL serves it: a document may
    /// say it is anyone, so one whose id is not `url` (a key URL that answers with the actor,
    /// as some servers do, or a forgery) is fetched again from its id, which must then match.
    async fn as_itself(&self, url: &str, document: Value, exempt: Option<&str>) -> Result<Value, KeyFetchError> {
        let id = id_of(&document).ok_or_else(|| invalid("the actor has no id"))?;
        if id == url {
            return Ok(document);
        }
        let own = self.fetch_document(id, exempt).await?;
        if id_of(&own) != Some(id) {
            return Err(invalid(format!("the actor document at {url} says it is {id}, whose document does not")));
        }
        Ok(own)
    }

    async fn fetch(&self, key_id: &str, known: bool) -> Result<RemoteActor, KeyFetchError> {
        bounded("key id", key_id)?;
        let document_url = key_document(key_id);
        let exempt = known.then(|| host_of(key_id)).flatten();
        let exempt = exempt.as_deref();
        let document = self.fetch_document(document_url, exempt).await?;
        let (actor, key) = if document.get("publicKeyPem").is_some() {
            // The key itself: its owner is the actor, which must publish it too (else any key
            // could name anyone as its owner).
            if id_of(&document) != Some(key_id) {
                return Err(invalid("the key document's id is not the key id"));
            }
            let owner = document.get("owner").and_then(Value::as_str).ok_or_else(|| invalid("the key has no owner"))?;
            let fetched = self.fetch_document(owner, exempt).await?;
            let actor = self.as_itself(owner, fetched, exempt).await?;
            let published =
                published_key(&actor, key_id).ok_or_else(|| invalid("the key's owner does not publish that key"))?;
            // The owner's copy of the key counts, when it carries the PEM.
            (actor, if published.get("publicKeyPem").is_some() { published } else { document })
        } else {
            let actor = self.as_itself(document_url, document, exempt).await?;
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

/// Drops the signers fetched longer than `ttl` ago, then, if that left `cache` more than half
/// full, the half least recently used: a flood of new key ids costs the keys in use the least.
fn make_room(cache: &mut KeyCache, ttl: Duration) {
    cache.retain(|_, c| c.fetched.elapsed() < ttl);
    if cache.len() > CACHED_KEYS / 2 {
        let mut used: Vec<Instant> = cache.values().map(|c| c.used).collect();
        let (_, median, _) = used.select_nth_unstable(cache.len() / 2);
        let median = *median;
        cache.retain(|_, c| c.used > median);
    }
}

/// The key `key_id` among those `actor` publishes (`publicKey`: one, or a list).
fn published_key(actor: &Value, key_id: &str) -> Option<Value> {
    match actor.get("publicKey")? {
        Value::Array(keys) => keys.iter().find(|key| id_of(key) == Some(key_id)).cloned(),
        key => (id_of(key) == Some(key_id)).then(|| key.clone()),
    }
}

/// The host of `url`, when it is a URL with one.
fn host_of(url: &str) -> Option<String> {
    url::Url::parse(url).ok()?.host_str().map(str::to_owned)
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
        assert!(!keys.cache.lock().unwrap().contains_key(&key_id));
        let short = "http://127.0.0.1:1/users/alice#main-key";
        assert!(matches!(keys.get(short, false).await, Err(KeyFetchError::Fetch(_))), "a short one is fetched");
    }

    /// A loopback server answering the `n`th request (from 0) with `answer(base URL, n)`,
    /// counting them; its base URL.
    async fn serving(
        answer: impl Fn(&str, usize) -> String + Send + Sync + 'static,
    ) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (counted, answer, served) = (count.clone(), Arc::new(answer), base.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (counted, answer, base) = (counted.clone(), answer.clone(), served.clone());
                tokio::spawn(async move {
                    let mut buffer = [0; 4096];
                    let _ = stream.read(&mut buffer).await;
                    let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let _ = stream.write_all(answer(&base, n).as_bytes()).await;
                });
            }
        });
        (base, count)
    }

    /// A loopback server answering every request 404, counting them; its base URL.
    async fn answering_404() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        serving(|_, _| "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into()).await
    }

    /// A key past its time to live is fetched again outside its host's share (which others' key
    /// ids can spend), and, its server not answering now (503), stands in; its failed fetch is
    /// not repeated within a minute. A key never fetched has no stand-in.
    #[tokio::test]
    async fn a_stale_key_stands_while_its_server_cannot_answer() {
        use std::sync::atomic::Ordering;
        let pem = reelay_activitypub::keys::generate().unwrap().public_key_pem;
        let (base, requests) = serving(move |base, n| {
            if n > 0 {
                return "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into();
            }
            let actor = format!("{base}/users/alice");
            let document = serde_json::json!({
                "id": actor, "type": "Person", "inbox": format!("{actor}/inbox"),
                "publicKey": { "id": format!("{actor}#main-key"), "owner": actor, "publicKeyPem": pem },
            })
            .to_string();
            let head = "HTTP/1.1 200 OK\r\ncontent-type: application/activity+json\r\nconnection: close";
            format!("{head}\r\ncontent-length: {}\r\n\r\n{document}", document.len())
        })
        .await;
        let http = FederationClient::new(Duration::from_secs(5), 1024 * 1024, true).unwrap();
        let keys = RemoteKeys::new(http, Duration::from_millis(1));
        let key_id = format!("{base}/users/alice#main-key");
        let fetched = keys.get(&key_id, false).await.unwrap();
        assert_eq!(fetched.source, KeySource::Fetched);
        // Others' key ids on the host spend its share this minute (a key never fetched has no
        // stand-in)...
        let other = |n: u32| format!("{base}/users/u{n}#main-key");
        for n in 1..FETCHES_PER_HOST {
            let error = keys.get(&other(n), false).await.unwrap_err();
            assert!(matches!(error, KeyFetchError::Fetch(_)) && error.is_transient(), "{error}");
        }
        assert!(matches!(keys.get(&other(0), false).await, Err(KeyFetchError::Throttled(_))));
        assert_eq!(requests.load(Ordering::SeqCst), FETCHES_PER_HOST as usize);
        // ...but a key id cached already is fetched again outside it, and stands in when that
        // fetch fails.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let stale = keys.get(&key_id, false).await.unwrap();
        assert!(Arc::ptr_eq(&fetched.actor, &stale.actor), "the key fetched before stands in");
        assert_eq!(stale.source, KeySource::StandIn, "past its time to live, and not fetched again");
        assert_eq!(requests.load(Ordering::SeqCst), FETCHES_PER_HOST as usize + 1, "it was asked for again");
        assert!(Arc::ptr_eq(&keys.get(&key_id, false).await.unwrap().actor, &fetched.actor));
        assert_eq!(
            requests.load(Ordering::SeqCst),
            FETCHES_PER_HOST as usize + 1,
            "a failed fetch is not repeated at once"
        );
    }

    /// A URL a document leads to (here the id an actor document claims) longer than any taken is
    /// refused unfetched, and the failure remembered is a short reason, not the URL.
    #[tokio::test]
    async fn a_long_url_in_a_document_is_refused_unfetched() {
        use std::sync::atomic::Ordering;
        let (base, requests) = serving(|base, _| {
            let document =
                serde_json::json!({ "id": format!("{base}/users/{}", "a".repeat(1 << 20)), "type": "Person" });
            let document = document.to_string();
            format!("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{document}", document.len())
        })
        .await;
        let http = FederationClient::new(Duration::from_secs(5), 2 << 20, true).unwrap();
        let keys = RemoteKeys::new(http, Duration::from_secs(60));
        let key_id = format!("{base}/users/alice#main-key");
        let error = keys.get(&key_id, false).await.unwrap_err();
        assert!(matches!(&error, KeyFetchError::Invalid(reason) if reason.contains("document URL")), "{error}");
        assert_eq!(requests.load(Ordering::SeqCst), 1, "the long id was not fetched");
        // A failure naming a long URL (the 404 of a key id near the longest) is kept short.
        let (base, _) = answering_404().await;
        let long = format!("{base}/users/{}#main-key", "a".repeat(1900));
        assert!(matches!(keys.get(&long, false).await, Err(KeyFetchError::Fetch(_))));
        let remembered = keys.fetches.lock().unwrap().failed[&long].1.reason.chars().count();
        assert_eq!(remembered, MAX_REASON_CHARS, "cut to its most");
    }

    /// A full cache drops what is past its time to live, then the half least recently used.
    #[test]
    fn a_full_cache_keeps_the_keys_in_use() {
        let pem = reelay_activitypub::keys::generate().unwrap().public_key_pem;
        let actor = Arc::new(RemoteActor {
            key: PublicKey::from_pem(&pem).unwrap(),
            actor_uri: "https://m.example/users/a".into(),
            inbox: None,
            shared_inbox: None,
        });
        let start = Instant::now();
        let mut cache: KeyCache = (0..CACHED_KEYS)
            .map(|n| {
                let used = start + Duration::from_millis(n as u64);
                (format!("k{n}"), Cached { fetched: start, used, actor: actor.clone() })
            })
            .collect();
        make_room(&mut cache, Duration::from_secs(3600));
        assert!(cache.len() <= CACHED_KEYS / 2 && cache.len() >= CACHED_KEYS / 2 - 1, "{}", cache.len());
        assert!(cache.contains_key(&format!("k{}", CACHED_KEYS - 1)) && !cache.contains_key("k0"));
        make_room(&mut cache, Duration::ZERO);
        assert!(cache.is_empty(), "all past their time to live");
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

    /// The counts of hosts and of failed key ids are bounded, and filling either (hosts and key
    /// ids are the signer's to choose) gives nobody's share back: only what is past its minute
    /// goes, and while they are full of this minute's, a new host waits and a new failure is
    /// not remembered.
    #[tokio::test]
    async fn filling_the_counts_gives_no_host_its_share_again() {
        use std::sync::atomic::Ordering;
        let (base, requests) = answering_404().await;
        let http = FederationClient::new(Duration::from_secs(5), 1024, true).unwrap();
        let keys = RemoteKeys::new(http, Duration::from_secs(60));
        let key_id = |n: u32| format!("{base}/users/u{n}#main-key");
        assert!(matches!(keys.get(&key_id(0), false).await, Err(KeyFetchError::Fetch(_))));
        let minute_ago = Instant::now().checked_sub(Duration::from_secs(61)).unwrap();
        {
            let mut fetches = keys.fetches.lock().unwrap();
            let failure = fetches.failed[&key_id(0)].clone();
            for n in 1..REMEMBERED {
                fetches.per_host.insert(format!("h{n}.example"), (Instant::now(), 1));
                fetches.failed.insert(format!("https://h{n}.example/k"), failure.clone());
            }
        }
        // The host fetched from already keeps counting; its failure is remembered still.
        assert!(matches!(keys.get(&key_id(0), true).await, Err(KeyFetchError::RecentlyFailed(_))));
        assert!(matches!(keys.get(&key_id(1), false).await, Err(KeyFetchError::Fetch(_))));
        {
            let fetches = keys.fetches.lock().unwrap();
            assert_eq!((fetches.per_host.len(), fetches.failed.len()), (REMEMBERED, REMEMBERED));
            assert!(!fetches.failed.contains_key(&key_id(1)), "not remembered: the failures are full");
            assert!(fetches.failed.contains_key(&key_id(0)));
        }
        // A new host waits while every counted one is within its minute...
        let elsewhere = "http://127.0.0.2:9/users/a#main-key";
        assert!(matches!(keys.get(elsewhere, false).await, Err(KeyFetchError::Throttled(_))));
        // ...and is counted once some minute is over, the others' counts kept.
        keys.fetches.lock().unwrap().per_host.insert("h1.example".into(), (minute_ago, 1));
        assert!(matches!(keys.get(elsewhere, false).await, Err(KeyFetchError::Fetch(_))));
        let fetches = keys.fetches.lock().unwrap();
        assert_eq!(fetches.per_host.len(), REMEMBERED);
        assert!(!fetches.per_host.contains_key("h1.example") && fetches.per_host.contains_key("h2.example"));
        assert_eq!(requests.load(Ordering::SeqCst), 2);
    }
}
