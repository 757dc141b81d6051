//! The federation handlers, three of them so each fails and retries on its own:
//!
//! - `federation` turns domain events into activities and queues them, through the write
//!   service, for the inboxes they go to: a local user's review logged, edited or deleted
//!   becomes `Create`/`Update`/`Delete` of a `Note` for every remote follower (one delivery per
//!   shared inbox); a remote follow gets its `Accept`; a local user's follow and unfollow of a
//!   remote actor become `Follow` and `Undo`. Every activity's id derives from its event's id, and
//!   the write service queues an activity id once, so running it twice queues once. Most
//!   reviews are by users with no remote follower: a batch's authors are looked up in one read
//!   (`UsersWithFollowers`) and only followed users' reviews become activities.
//! - `federation-delivery` delivers one queued activity to one inbox, signed by its actor (the
//!   write service signs; the private key never leaves it). Each inbox is its own event with
//!   its own attempts: a dead inbox holds back no other. 2xx is done; 410 Gone removes the
//!   followers at that inbox; another 4xx but 401, 408 and 429 fails for good; those three,
//!   3xx, 5xx and timeouts are retried. Each failure but 401 and 429 is recorded against the
//!   inbox's server, and an answer from a server so recorded clears it: a server failing every
//!   delivery for a week (`REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS`) is left out of fan-outs
//!   but for a probe now and then, which is dropped if it fails.
//! - `federation-backfill`, once a remote actor accepts a local user's follow, reads the actor's
//!   outbox (signed GETs, page after page) and saves its reviews (upserts by object id).
//!
//! They own no state: what they do is recorded by the write service, or at the remote server.

mod activities;
mod backfill;
mod delivery;
mod remote;

use std::sync::Arc;
use std::time::Duration;

pub use activities::ActivitiesHandler;
use anyhow::Context;
pub use backfill::BackfillHandler;
pub use delivery::DeliveryHandler;
use reelay_activitypub::Urls;
use reelay_delivery::{BuiltHandler, HandlerContext};
pub use remote::Remote;

/// The handlers of this crate, by name.
pub const NAMES: [&str; 3] = ["federation", "federation-delivery", "federation-backfill"];

/// The federation handlers' settings.
#[derive(Debug, Clone, clap::Args)]
pub struct FederationSettings {
    /// The public origin of this instance (`https://reelay.example`): every ActivityPub id is
    /// built on it. Defaults to `http://<REELAY_GATEWAY_ADDR>`.
    #[arg(id = "public_url", long = "public-url", env = "REELAY_PUBLIC_URL")]
    pub public_url: Option<String>,

    /// Deadline of one outgoing request (a delivery, a fetch), in milliseconds (100 ms to 10
    /// minutes).
    #[arg(
        id = "federation_timeout_ms",
        long = "federation-timeout-ms",
        env = "REELAY_FEDERATION_TIMEOUT_MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(100..=600_000)
    )]
    pub timeout_ms: u64,

    /// Whether outgoing requests (deliveries, fetches, and the gateway's key fetches) may reach
    /// loopback, private and other non-public addresses. Off unless `REELAY_DEV` (a local setup
    /// whose peers are on this machine): the URLs come from other servers, and private
    /// addresses are this network's own services.
    #[arg(
        id = "federation_allow_private",
        long = "federation-allow-private",
        env = "REELAY_FEDERATION_ALLOW_PRIVATE",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub allow_private: Option<bool>,

    /// The most outbox pages a backfill reads (1 to 1000; the first page is always read). A
    /// backfill also stops after 40 s, and reads the first 100 items of each page.
    #[arg(
        id = "federation_backfill_pages",
        long = "federation-backfill-pages",
        env = "REELAY_FEDERATION_BACKFILL_PAGES",
        default_value_t = 10,
        value_parser = clap::value_parser!(u32).range(1..=1000)
    )]
    pub backfill_pages: u32,
}

impl Default for FederationSettings {
    fn default() -> Self {
        Self { public_url: None, timeout_ms: 10_000, allow_private: None, backfill_pages: 10 }
    }
}

/// Largest answer read from a remote server.
const MAX_RESPONSE_BYTES: usize = 2 * 1024 * 1024;

/// What every federation handler reaches through.
pub fn remote(settings: &FederationSettings, context: &HandlerContext) -> anyhow::Result<Remote> {
    let public_url = settings
        .public_url
        .as_deref()
        .context("the federation handlers need REELAY_PUBLIC_URL (or REELAY_GATEWAY_ADDR) to name what they send")?;
    let urls = Urls::new(public_url).map_err(anyhow::Error::msg)?;
    let http = reelay_activitypub::client::FederationClient::new(
        Duration::from_millis(settings.timeout_ms),
        MAX_RESPONSE_BYTES,
        settings.allow_private.unwrap_or(false),
    )
    .map_err(anyhow::Error::msg)?;
    Ok(Remote::new(urls, http, context.write.clone()))
}

/// Builds the federation handler named `name` (one of [`NAMES`]).
pub fn build(name: &str, settings: &FederationSettings, context: &HandlerContext) -> anyhow::Result<BuiltHandler> {
    let remote = remote(settings, context)?;
    let handler: Arc<dyn reelay_delivery::Handler> = match name {
        "federation" => Arc::new(ActivitiesHandler::new(remote)),
        "federation-delivery" => Arc::new(DeliveryHandler::new(remote)),
        "federation-backfill" => Arc::new(BackfillHandler::new(remote, settings.backfill_pages)),
        other => anyhow::bail!("no federation handler is named {other:?}"),
    };
    Ok(BuiltHandler { handler, grpc: None })
}
