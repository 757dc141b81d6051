//! ActivityPub as Reelay speaks it, shared by the write service (keys, signing), the gateway
//! (verifying, serving documents) and the federation handlers (sending, backfilling):
//!
//! - [`keys`]: each local user's RSA key pair. `rsa` only generates keys and reads public keys;
//!   every signature is made and checked by `ring`, whose RSA is constant-time (the `rsa`
//!   crate's private-key operations are not: RUSTSEC-2023-0071).
//! - [`signature`]: HTTP Signatures as Mastodon sends and checks them (draft-cavage-12,
//!   `rsa-sha256` / `hs2019`, `Digest: SHA-256=`).
//! - [`urls`]: the ids of everything this instance publishes, derived from the public origin;
//!   every activity id derives from the event that caused it.
//! - [`documents`]: the JSON documents served and sent (actors, Notes, activities, collections).
//! - [`note`]: reading a remote review out of a Note.
//! - `client` (feature `client`): the outbound HTTP client.
//!
//! It owns no state and performs no I/O except in the client.

#[cfg(feature = "client")]
pub mod client;
pub mod documents;
pub mod keys;
pub mod note;
pub mod signature;
pub mod time;
pub mod urls;

/// The media type of ActivityPub documents.
pub const ACTIVITY_JSON: &str = "application/activity+json";
/// The other media type servers send and accept for ActivityPub.
pub const LD_JSON: &str = "application/ld+json; profile=\"https://www.w3.org/ns/activitystreams\"";
/// The audience "everyone".
pub const PUBLIC: &str = "https://www.w3.org/ns/activitystreams#Public";

pub use urls::Urls;
