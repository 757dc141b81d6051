//! The internal APIs of the write service: Outbox (claim and settle event rows) and Ledger
//! (claim and settle (event, handler) pairs). Both are used by the relay and the handler
//! services; neither is part of the public domain API.
//!
//! `outbox` and `ledger` implement them; this file mounts both and holds what they share.

use reelay_contracts::v1::{ledger_server::LedgerServer, outbox_server::OutboxServer};
use reelay_outbox::Database;
use reelay_outbox::ledger::LedgerPolicy;
use reelay_outbox::queue::QueuePolicy;
use reelay_runtime::{GrpcServer, Shutdown};

use super::ledger::LedgerApi;
use super::outbox::OutboxApi;

pub(super) const MAX_BATCH_KEYS: usize = 1000;

/// The outbox and ledger settings the write service enforces.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeliveryPolicy {
    pub queue: QueuePolicy,
    pub ledger: LedgerPolicy,
}

/// Mounts Outbox and Ledger on `server`.
pub fn mount_internal(server: GrpcServer, db: Database, policy: DeliveryPolicy, shutdown: Shutdown) -> GrpcServer {
    let limit = server.config().max_message_bytes;
    let outbox = OutboxApi { db: db.clone(), policy: policy.queue, shutdown, max_message_bytes: limit };
    let ledger = LedgerApi { db, policy: policy.ledger };
    server
        .add_service(OutboxServer::new(outbox).max_decoding_message_size(limit).max_encoding_message_size(limit))
        .add_service(LedgerServer::new(ledger).max_decoding_message_size(limit).max_encoding_message_size(limit))
}
