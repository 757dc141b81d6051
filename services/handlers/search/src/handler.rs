//! The search handler: keeps the index in step with the events that change what can be found.

use reelay_contracts::v1;
use reelay_delivery::{Handler, HandlerError};

use crate::SearchIndex;

const EVENT_TYPES: &[&str] = &[
    "ReviewLogged",
    "ReviewEdited",
    "ReviewDeleted",
    "RemoteReviewSaved",
    "RemoteReviewDeleted",
    "MovieDiscovered",
    "MovieEnriched",
    "MovieDeleted",
    "PosterSynced",
    "PosterConverted",
];

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

    fn batches(&self) -> bool {
        true
    }

    /// One commit per batch: a tantivy commit fsyncs, so it is the cost worth sharing.
    async fn handle_batch(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
        self.index.apply(events).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::*;

    #[tokio::test]
    async fn handling_an_event_twice_has_the_effect_of_once() {
        let dir = tempfile::tempdir().unwrap();
        let index = SearchIndex::open(dir.path()).unwrap();
        let handler = SearchHandler::new(index.clone());
        assert_eq!(handler.name(), "search");
        let logged = review_logged("r1", 100, "Heat", "the diner scene");
        assert!(handler.subscribes_to(&logged.event_type));

        handler.handle(&logged).await.unwrap();
        let docs = index.num_docs();
        let hits = index.search_reviews("diner", 0, 10).await.unwrap();
        handler.handle(&logged).await.unwrap();
        assert_eq!(handler.handle_batch(&[&logged, &logged]).await, [Ok(()), Ok(())]);
        assert_eq!(index.num_docs(), docs);
        assert_eq!(index.search_reviews("diner", 0, 10).await.unwrap(), hits);
        assert_eq!(hits.total_hits, 1);
    }

    #[test]
    fn subscribes_to_every_event_the_index_reads() {
        let events = [
            review_logged("r", 1, "Heat", "x"),
            review_edited("r", 1, "Heat", "x"),
            review_deleted("r", 1),
            remote_review_saved("r", 1, "Heat", "x"),
            remote_review_deleted("r", 1),
            movie_discovered("m", 1, "Heat", 1995),
            movie_enriched("m", 1, "Heat", 1995, &["Michael Mann"], &["Crime"]),
            movie_deleted("m", 1),
            poster_synced("m", 1),
            poster_converted("m", 1, &["w92"]),
        ];
        let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
        assert_eq!(EVENT_TYPES, types.as_slice());
    }
}
