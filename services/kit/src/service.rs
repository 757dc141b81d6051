//! The services one `reelay` binary can run.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Service {
    /// Owns SQLite: the domain API, the outbox and the ledger.
    Write,
    /// Drains the outbox to NATS JetStream.
    Relay,
    /// Runs event handlers.
    Handlers,
    /// The public ActivityPub HTTP side (WebFinger, actors, inboxes, outboxes).
    Gateway,
}

impl Service {
    pub const ALL: [Service; 4] = [Service::Write, Service::Relay, Service::Handlers, Service::Gateway];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Write => "write",
            Self::Relay => "relay",
            Self::Handlers => "handlers",
            Self::Gateway => "gateway",
        }
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Service {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|service| service.as_str() == s)
            .ok_or_else(|| format!("unknown service {s:?}; expected one of: write, relay, handlers, gateway"))
    }
}
