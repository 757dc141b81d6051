//! The internal APIs of the write service: Outbox (claim and settle event rows), Ledger (claim
//! and settle (event, handler) pairs), both used by the relay and the handler services, and
//! Admin (status, explain, dead letters) for operators. None is part of the public domain API.
//!
//! `outbox`, `ledger` and `admin` implement them; this file mounts them and holds what they
//! share.

use reelay_contracts::v1::{admin_server::AdminServer, ledger_server::LedgerServer, outbox_server::OutboxServer};
use reelay_kit::{GrpcServer, ServiceError, Shutdown};
use reelay_outbox::Database;
use reelay_outbox::deliveries::HandlerPolicy;
use reelay_outbox::ledger::LedgerPolicy;
use reelay_outbox::queue::QueuePolicy;

use super::admin::{AdminApi, Bus};
use super::deliveries::waiting_deliveries;
use super::ledger::LedgerApi;
use super::outbox::{OutboxApi, waiting_rows};
use crate::store::ServerPolicy;

pub(super) const MAX_BATCH_KEYS: usize = 1000;

/// An event type of the catalogue.
pub(super) fn event_type(field: &str, name: &str) -> Result<String, ServiceError> {
    if !reelay_domain::EVENT_TYPES.contains(&name) {
        return Err(ServiceError::invalid(
            field,
            format!("unknown event type {name:?}; one of: {}", reelay_domain::EVENT_TYPES.join(", ")),
        ));
    }
    Ok(name.to_owned())
}

/// A handler's name as ledger keys and cursors use it.
pub(super) fn handler_name(field: &str, name: &str) -> Result<String, ServiceError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid {
        return Err(ServiceError::invalid(field, format!("must be 1-64 of a-z, 0-9, '-', got {name:?}")));
    }
    Ok(name.to_owned())
}

/// The outbox and ledger settings the write service enforces.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeliveryPolicy {
    pub queue: QueuePolicy,
    pub ledger: LedgerPolicy,
    /// Per-handler delivery on the db backend.
    pub deliveries: HandlerPolicy,
    /// The event bus the deployment delivers through.
    pub bus: Bus,
}

/// Mounts Outbox, Ledger and Admin on `server`. `servers`: how federation leaves failing
/// servers out, which Admin reports on.
pub fn mount_internal(
    server: GrpcServer,
    db: Database,
    policy: DeliveryPolicy,
    servers: ServerPolicy,
    shutdown: Shutdown,
) -> GrpcServer {
    let limit = server.config().max_message_bytes;
    // A batch as long as a third of the shortest of them may have held a renewal back.
    db.writer.set_shortest_lease(policy.queue.lease.min(policy.ledger.lease).min(policy.deliveries.lease));
    let outbox = OutboxApi {
        db: db.clone(),
        policy: policy.queue,
        deliveries: policy.deliveries,
        shutdown,
        max_message_bytes: limit,
        delivery_claims: Default::default(),
        delivery_settlements: Default::default(),
        waiting_deliveries: waiting_deliveries(policy.deliveries),
        waiting_rows: waiting_rows(policy.queue),
        running_deliveries: Default::default(),
        running_rows: Default::default(),
        bus: policy.bus,
    };
    // Whoever takes new events on this backend has its waiting claims written with them.
    match policy.bus {
        Bus::Db => outbox.waiting_deliveries.ride_with(&db.writer),
        Bus::Nats => outbox.waiting_rows.ride_with(&db.writer),
    }
    let ledger = LedgerApi { db: db.clone(), policy: policy.ledger, bus: policy.bus };
    let admin = AdminApi {
        db,
        bus: policy.bus,
        lease: policy.ledger.lease.max(policy.deliveries.lease),
        leaves_servers_out: servers.leaves_out(),
    };
    server
        .add_service(OutboxServer::new(outbox).max_decoding_message_size(limit).max_encoding_message_size(limit))
        .add_service(LedgerServer::new(ledger).max_decoding_message_size(limit).max_encoding_message_size(limit))
        .add_service(AdminServer::new(admin).max_decoding_message_size(limit).max_encoding_message_size(limit))
}
