//! A Mastodon-shaped ActivityPub peer for tests: a small HTTP server on loopback with its own
//! actors and RSA key, that signs what it sends and checks what it receives exactly as
//! Mastodon documents it (draft-cavage HTTP signatures, `rsa-sha256`, signed
//! `(request-target) host date digest content-type`, `Digest: SHA-256=`).
//!
//! Its signing and checking are written here, independently of Reelay's `reelay-activitypub`
//! crate, so a mistake there cannot hide behind the same mistake here. It talks plain HTTP/1.1
//! over loopback with a client of its own, so tests can send exactly the bytes they mean to
//! (tampered bodies, stale dates, unsigned requests).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use ring::signature::{RSA_PKCS1_2048_8192_SHA256, RSA_PKCS1_SHA256, RsaKeyPair, RsaPublicKeyComponents};
use rsa::pkcs8::{DecodePublicKey, EncodePrivateKey, EncodePublicKey, LineEnding};
use rsa::traits::PublicKeyParts;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One activity the peer received, with what its checks found.
#[derive(Debug, Clone)]
pub struct Received {
    /// The inbox path it was posted to.
    pub path: String,
    pub activity: Value,
    /// The signature verified with the key fetched from its keyId, over the headers Mastodon
    /// requires, and the digest matched the body.
    pub verified: Result<(), String>,
    pub key_id: String,
    /// What the peer answered.
    pub status: u16,
}

struct KeyPair {
    der: Vec<u8>,
    pem: String,
}

impl KeyPair {
    fn generate() -> Self {
        let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048).expect("generate a peer key");
        Self {
            der: key.to_pkcs8_der().expect("encode the peer key").as_bytes().to_vec(),
            pem: key.to_public_key().to_public_key_pem(LineEnding::LF).expect("encode the peer public key"),
        }
    }

    fn sign(&self, message: &str) -> Vec<u8> {
        let pair = RsaKeyPair::from_pkcs8(&self.der).expect("load the peer key");
        let mut signature = vec![0; pair.public().modulus_len()];
        pair.sign(&RSA_PKCS1_SHA256, &ring::rand::SystemRandom::new(), message.as_bytes(), &mut signature)
            .expect("sign");
        signature
    }
}

struct Inner {
    addr: SocketAddr,
    key: KeyPair,
    /// Another key, to sign with while claiming `key`'s id.
    wrong_key: KeyPair,
    received: Mutex<Vec<Received>>,
    inbox_status: Mutex<u16>,
    /// Each actor's outbox pages, served at `/users/<name>/outbox/<n>` (none: no outbox).
    outboxes: Mutex<HashMap<String, Vec<Value>>>,
    /// Actors whose account is deleted: their documents answer 410 Gone.
    gone: Mutex<Vec<String>>,
}

/// The peer. Its actors are `http://<addr>/users/<name>`, each with an inbox, all sharing one
/// shared inbox (`/inbox`) and one key (`#main-key`).
#[derive(Clone)]
pub struct MastodonPeer {
    inner: Arc<Inner>,
}

/// How a request is to be spoiled, for the tests of what an inbox refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spoil {
    None,
    Unsigned,
    /// Signed with another key than the one the keyId names.
    WrongKey,
    /// Signed over one body, sent with another.
    TamperedBody,
    /// Dated two days ago.
    StaleDate,
    /// Signed with another key, whose keyId is a document at `/forged/<name>` that says it is
    /// the actor `<name>` (an impersonation: the real actor does not publish that key).
    ForgedActor,
    /// Signed with another key, whose keyId is a key document at `/keys/<name>` naming the
    /// actor `<name>` as its owner (who does not publish it).
    ForgedKey,
    /// Signed for another server (`Host: elsewhere.example`, signed and sent), as a request
    /// taken from another server's inbox and replayed here would be.
    OtherHost,
}

fn sha256_digest(body: &[u8]) -> String {
    format!("SHA-256={}", B64.encode(ring::digest::digest(&ring::digest::SHA256, body)))
}

impl MastodonPeer {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the peer");
        let addr = listener.local_addr().unwrap();
        let inner = Arc::new(Inner {
            addr,
            key: KeyPair::generate(),
            wrong_key: KeyPair::generate(),
            received: Mutex::default(),
            inbox_status: Mutex::new(202),
            outboxes: Mutex::default(),
            gone: Mutex::default(),
        });
        let peer = Self { inner };
        let app = Router::new()
            .route("/users/{name}", get(actor))
            .route("/forged/{name}", get(forged_actor))
            .route("/keys/{name}", get(forged_key))
            .route("/users/{name}/inbox", post(inbox))
            .route("/users/{name}/outbox", get(outbox))
            .route("/users/{name}/outbox/{page}", get(outbox_page))
            .route("/inbox", post(inbox_shared))
            .with_state(peer.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        peer
    }

    pub fn base(&self) -> String {
        format!("http://{}", self.inner.addr)
    }

    pub fn actor(&self, name: &str) -> String {
        format!("{}/users/{name}", self.base())
    }

    pub fn key_id(&self, name: &str) -> String {
        format!("{}#main-key", self.actor(name))
    }

    /// Gives `name` an outbox of `pages` (`OrderedCollectionPage`s; a `next` past them is 404).
    pub fn set_outbox(&self, name: &str, pages: Vec<Value>) {
        self.inner.outboxes.lock().unwrap().insert(name.to_owned(), pages);
    }

    /// Deletes `name`'s account: its actor document answers 410 Gone from now on (it can still
    /// sign, as Mastodon signs a deleted account's Deletes).
    pub fn delete_account(&self, name: &str) {
        self.inner.gone.lock().unwrap().push(name.to_owned());
    }

    /// What the inboxes answer from now on (202 by default).
    pub fn set_inbox_status(&self, status: u16) {
        *self.inner.inbox_status.lock().unwrap() = status;
    }

    pub fn received(&self) -> Vec<Received> {
        self.inner.received.lock().unwrap().clone()
    }

    /// Received activities of `kind`.
    pub fn received_of(&self, kind: &str) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.activity["type"] == kind).collect()
    }

    /// Posts `body` to `url` signed as `name`, as Mastodon does; returns the status.
    pub async fn post(&self, name: &str, url: &str, body: &[u8], spoil: Spoil) -> u16 {
        let (host, path) = split_url(url);
        let host = if spoil == Spoil::OtherHost { "elsewhere.example".to_owned() } else { host };
        let date = match spoil {
            Spoil::StaleDate => {
                httpdate::fmt_http_date(std::time::SystemTime::now() - std::time::Duration::from_secs(2 * 86_400))
            }
            _ => httpdate::fmt_http_date(std::time::SystemTime::now()),
        };
        let signed_body: Vec<u8> =
            if spoil == Spoil::TamperedBody { b"{\"type\":\"Like\"}".to_vec() } else { body.to_vec() };
        let digest = sha256_digest(&signed_body);
        let content_type = "application/activity+json";
        let signing_string = format!(
            "(request-target): post {path}\nhost: {host}\ndate: {date}\ndigest: {digest}\ncontent-type: {content_type}"
        );
        let key = match spoil {
            Spoil::WrongKey | Spoil::ForgedActor | Spoil::ForgedKey => &self.inner.wrong_key,
            _ => &self.inner.key,
        };
        let key_id = match spoil {
            Spoil::ForgedActor => format!("{}/forged/{name}#main-key", self.base()),
            Spoil::ForgedKey => format!("{}/keys/{name}", self.base()),
            _ => self.key_id(name),
        };
        let signature = format!(
            "keyId=\"{key_id}\",algorithm=\"rsa-sha256\",headers=\"(request-target) host date digest content-type\",signature=\"{}\"",
            B64.encode(key.sign(&signing_string))
        );
        let mut headers =
            vec![("Host", host.clone()), ("Date", date), ("Digest", digest), ("Content-Type", content_type.into())];
        if spoil != Spoil::Unsigned {
            headers.push(("Signature", signature));
        }
        http_request("POST", url, &headers, body).await.0
    }

    /// Posts a JSON activity signed as `name`.
    pub async fn send(&self, name: &str, url: &str, activity: &Value) -> u16 {
        self.post(name, url, activity.to_string().as_bytes(), Spoil::None).await
    }

    /// Checks one signed POST the way Mastodon's inbox does.
    async fn verify(&self, method: &str, path: &str, headers: &HeaderMap, body: &[u8]) -> (Result<(), String>, String) {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let Some(signature) = header("signature") else { return (Err("unsigned".into()), String::new()) };
        let params: HashMap<String, String> = signature
            .split(',')
            .filter_map(|part| part.split_once('='))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().trim_matches('"').to_owned()))
            .collect();
        let key_id = params.get("keyId").cloned().unwrap_or_default();
        let check = async {
            if params.get("algorithm").map(String::as_str) != Some("rsa-sha256") {
                return Err(format!("algorithm {:?}", params.get("algorithm")));
            }
            let signed: Vec<&str> = params.get("headers").map(|h| h.split(' ').collect()).unwrap_or_default();
            for required in ["(request-target)", "host", "date", "digest"] {
                if !signed.contains(&required) {
                    return Err(format!("{required} is not signed"));
                }
            }
            if header("digest") != Some(sha256_digest(body)) {
                return Err("the digest does not match the body".into());
            }
            let age = httpdate::parse_http_date(&header("date").unwrap_or_default())
                .map_err(|_| "no date".to_owned())?
                .elapsed()
                .map(|d| d.as_secs())
                .unwrap_or(0);
            if age > 12 * 3600 {
                return Err("stale".into());
            }
            let mut lines = Vec::new();
            for name in &signed {
                let value = if *name == "(request-target)" {
                    format!("{} {path}", method.to_lowercase())
                } else {
                    header(name).ok_or_else(|| format!("{name} is missing"))?
                };
                lines.push(format!("{name}: {value}"));
            }
            let document_url = key_id.split('#').next().unwrap_or_default();
            let (status, _, actor) =
                http_request("GET", document_url, &[("Accept", "application/activity+json".into())], b"").await;
            if status != 200 {
                return Err(format!("key fetch answered {status}"));
            }
            let actor: Value = serde_json::from_slice(&actor).map_err(|e| e.to_string())?;
            if actor["publicKey"]["id"] != key_id.as_str() || actor["publicKey"]["owner"] != actor["id"] {
                return Err("the actor does not own that key".into());
            }
            let pem = actor["publicKey"]["publicKeyPem"].as_str().ok_or("no pem")?;
            let public = rsa::RsaPublicKey::from_public_key_pem(pem).map_err(|e| e.to_string())?;
            let components = RsaPublicKeyComponents { n: public.n().to_bytes_be(), e: public.e().to_bytes_be() };
            let signature =
                B64.decode(params.get("signature").cloned().unwrap_or_default()).map_err(|e| e.to_string())?;
            components
                .verify(&RSA_PKCS1_2048_8192_SHA256, lines.join("\n").as_bytes(), &signature)
                .map_err(|_| "the signature does not verify".to_owned())
        };
        (check.await, key_id)
    }
}

/// An actor's document; an actor named `long-inbox` has an inbox of 3,000 characters.
async fn actor(State(peer): State<MastodonPeer>, Path(name): Path<String>) -> Response {
    if peer.inner.gone.lock().unwrap().contains(&name) {
        return StatusCode::GONE.into_response();
    }
    let id = peer.actor(&name);
    let inbox = if name == "long-inbox" { format!("{id}/{}", "i".repeat(3000)) } else { format!("{id}/inbox") };
    let document = json!({
        "@context": ["https://www.w3.org/ns/activitystreams", "https://w3id.org/security/v1"],
        "id": id,
        "type": "Person",
        "preferredUsername": name,
        "inbox": inbox,
        "outbox": format!("{id}/outbox"),
        "endpoints": { "sharedInbox": format!("{}/inbox", peer.base()) },
        "publicKey": { "id": peer.key_id(&name), "owner": id, "publicKeyPem": peer.inner.key.pem },
    });
    ([("content-type", "application/activity+json")], document.to_string()).into_response()
}

/// A document that says it is the actor `name`, with a key the actor does not publish.
async fn forged_actor(State(peer): State<MastodonPeer>, Path(name): Path<String>) -> Response {
    let id = peer.actor(&name);
    let key_id = format!("{}/forged/{name}#main-key", peer.base());
    let document = json!({
        "@context": ["https://www.w3.org/ns/activitystreams", "https://w3id.org/security/v1"],
        "id": id,
        "type": "Person",
        "inbox": format!("{}/forged/{name}/inbox", peer.base()),
        "publicKey": { "id": key_id, "owner": id, "publicKeyPem": peer.inner.wrong_key.pem },
    });
    ([("content-type", "application/activity+json")], document.to_string()).into_response()
}

/// A key document naming the actor `name` as its owner, who does not publish it.
async fn forged_key(State(peer): State<MastodonPeer>, Path(name): Path<String>) -> Response {
    let document = json!({
        "@context": "https://w3id.org/security/v1",
        "id": format!("{}/keys/{name}", peer.base()),
        "owner": peer.actor(&name),
        "publicKeyPem": peer.inner.wrong_key.pem,
    });
    ([("content-type", "application/activity+json")], document.to_string()).into_response()
}

async fn inbox(State(peer): State<MastodonPeer>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    receive(peer, uri, headers, body).await
}

async fn outbox(State(peer): State<MastodonPeer>, Path(name): Path<String>) -> Response {
    if !peer.inner.outboxes.lock().unwrap().contains_key(&name) {
        return StatusCode::NOT_FOUND.into_response();
    }
    let id = format!("{}/outbox", peer.actor(&name));
    let collection = json!({ "id": id, "type": "OrderedCollection", "first": format!("{id}/0") });
    ([("content-type", "application/activity+json")], collection.to_string()).into_response()
}

async fn outbox_page(State(peer): State<MastodonPeer>, Path((name, page)): Path<(String, usize)>) -> Response {
    match peer.inner.outboxes.lock().unwrap().get(&name).and_then(|pages| pages.get(page)) {
        Some(page) => ([("content-type", "application/activity+json")], page.to_string()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn inbox_shared(State(peer): State<MastodonPeer>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    receive(peer, uri, headers, body).await
}

async fn receive(peer: MastodonPeer, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let (verified, key_id) = peer.verify("POST", uri.path(), &headers, &body).await;
    let activity = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let status = *peer.inner.inbox_status.lock().unwrap();
    peer.inner.received.lock().unwrap().push(Received {
        path: uri.path().to_owned(),
        activity,
        verified,
        key_id,
        status,
    });
    StatusCode::from_u16(status).unwrap_or(StatusCode::ACCEPTED).into_response()
}

/// `http://host:port/path?q` → (`host:port`, `/path?q`).
fn split_url(url: &str) -> (String, String) {
    let rest = url.strip_prefix("http://").expect("the peer speaks plain HTTP on loopback");
    match rest.find('/') {
        Some(slash) => (rest[..slash].to_owned(), rest[slash..].to_owned()),
        None => (rest.to_owned(), "/".to_owned()),
    }
}

/// One HTTP/1.1 exchange over loopback (`Connection: close`): status, headers, body.
pub async fn http_request(method: &str, url: &str, headers: &[(&str, String)], body: &[u8]) -> (u16, String, Vec<u8>) {
    let (host, path) = split_url(url);
    let stream = tokio::net::TcpStream::connect(&host).await.expect("connect");
    let mut request = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {host}\r\n"));
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\nConnection: close\r\n\r\n", body.len()));
    // A server may answer (413) before reading the whole body, and close: read while writing,
    // so that answer is not lost.
    let (mut read, mut write) = stream.into_split();
    let mut sent = request.into_bytes();
    sent.extend_from_slice(body);
    let writer = tokio::spawn(async move {
        let _ = write.write_all(&sent).await;
        write
    });
    let mut response = Vec::new();
    let _ = read.read_to_end(&mut response).await;
    drop(writer.await);
    let split = response.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(response.len());
    let head = String::from_utf8_lossy(&response[..split]).into_owned();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut body = response.get(split + 4..).unwrap_or_default().to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, head, body)
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&data[..line_end]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        out.extend_from_slice(&data[start..(start + size).min(data.len())]);
        data = data.get(start + size + 2..).unwrap_or_default();
    }
    out
}

/// GETs an ActivityPub document as JSON (unsigned); the status and the document.
pub async fn get_json(url: &str) -> (u16, Value) {
    let (status, _, body) = http_request("GET", url, &[("Accept", "application/activity+json".into())], b"").await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}
