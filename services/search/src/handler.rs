//! The search handler: keeps the index in step with the events that change what can be found.

use reelay_contracts::v1;
use reelay_runtime::{Handler, HandlerError};

use crate::SearchIndex;

const EVENT_TYPES: &[&str] =
    &["ReviewLogged", "ReviewEdited", "ReviewDeleted", "RemoteReviewSaved", "MovieDiscovered", "MovieDeleted"];

pub struct SearchHandler {
    index: SearchIndex,
}

impl SearchHandler {
    pub fn new(index: SearchIndex) -> Self {
        Self { index }
    }
}

#[async_trait::async_trait]
impl Handler for SearchHandler {
    fn name(&self) -> &'static str {
        "search"
    }

    fn event_types(&self) -> &'static [&'static str] {
        EVENT_TYPES
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        self.index.apply(&[event]).await.pop().unwrap_or(Ok(()))
    }

    /// One commit per batch: a tantivy commit fsyncs, so it is the cost worth sharing.
    async fn handle_batch(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
        self.index.apply(events).await
    }
}
