//! The domain gRPC API: validate the request (naming the bad field), run the command, map the
//! result. No handler here opens a transaction; the store does.

use reelay_contracts::v1::{
    federation_server::FederationServer, integrations_server::IntegrationsServer, movies_server::MoviesServer,
    reviews_server::ReviewsServer, social_server::SocialServer, users_server::UsersServer,
    watchlist_server::WatchlistServer, wrap_ups_server::WrapUpsServer,
};
use reelay_kit::{GrpcServer, ServiceError};
use tonic::{Response, Status};

use crate::actor_keys::ActorKeys;
use crate::request_ids::RequestKey;
use crate::store::Store;

mod admin;
mod deliveries;
mod federation;
mod integrations;
mod internal;
mod ledger;
mod movies;
mod outbox;
mod reviews;
mod social;
mod unanswered;
mod users;
mod waiting;
mod watchlist;
mod wrap_ups;

pub use admin::{Bus, sample_status};
pub use deliveries::{note_lease, register_handlers};
pub use internal::{DeliveryPolicy, mount_internal};
pub(crate) use ledger::register_metrics as register_ledger_metrics;
pub(crate) use outbox::register_metrics as register_outbox_metrics;

type Reply<T> = Result<Response<T>, Status>;

fn ok<T>(value: T) -> Reply<T> {
    Ok(Response::new(value))
}

/// Takes the `request_id` out of `request` and returns the call's idempotency key (`None` when
/// it carries none); the fingerprint covers the rest of the request.
fn request_key<M: prost::Message>(
    method: &'static str,
    request: &mut M,
    request_id: impl FnOnce(&mut M) -> &mut String,
) -> Result<Option<RequestKey>, ServiceError> {
    keyed_by_actor(method, request, request_id, |_| "")
}

/// [`request_key`] for a method acting as a user (`actor`: its `actor_user_id`): the key is
/// that user's.
fn keyed_by_actor<M: prost::Message>(
    method: &'static str,
    request: &mut M,
    request_id: impl FnOnce(&mut M) -> &mut String,
    actor: impl FnOnce(&M) -> &str,
) -> Result<Option<RequestKey>, ServiceError> {
    let id = std::mem::take(request_id(request));
    RequestKey::of(method, actor(request), &id, request)
}

/// Mounts every domain service on `server`, each with the server's message-size limit (WrapUps
/// answering up to `WRAP_UP_INPUTS_MAX_BYTES`, a year's inputs in one message). `keys`
/// signs for the Federation service and hears of new users; `media_url` is where the media route
/// serves stored objects (wrap-up cards), if anywhere.
pub fn mount(server: GrpcServer, store: Store, keys: ActorKeys, media_url: Option<String>) -> GrpcServer {
    let api = WriteApi { keys, store, media_url };
    let limit = server.config().max_message_bytes;
    macro_rules! limited {
        ($server:ident) => {
            limited!($server, limit)
        };
        ($server:ident, $encode:expr) => {
            $server::new(api.clone()).max_decoding_message_size(limit).max_encoding_message_size($encode)
        };
    }
    server
        .add_service(limited!(UsersServer))
        .add_service(limited!(MoviesServer))
        .add_service(limited!(ReviewsServer))
        .add_service(limited!(WatchlistServer))
        .add_service(limited!(WrapUpsServer, limit.max(reelay_domain::WRAP_UP_INPUTS_MAX_BYTES)))
        .add_service(limited!(SocialServer))
        .add_service(limited!(IntegrationsServer))
        .add_service(limited!(FederationServer))
}

#[derive(Clone)]
struct WriteApi {
    store: Store,
    media_url: Option<String>,
    keys: ActorKeys,
}
