//! `image-cleanup` (on `MovieDeleted`): deletes every key under `posters/<movie_id>/`. A key
//! already gone counts as deleted, so a redelivery, or a run racing another, is a no-op.

use reelay_contracts::v1::{self, event::Payload};
use reelay_delivery::{Handler, HandlerError};
use reelay_objects::Objects;

/// Deletes a deleted movie's images.
pub struct ImageCleanup {
    pub(crate) objects: Objects,
}

#[async_trait::async_trait]
impl Handler for ImageCleanup {
    fn name(&self) -> &'static str {
        "image-cleanup"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["MovieDeleted"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::MovieDeleted(deleted)) = &event.payload else { return Ok(()) };
        let id = deleted.movie_id.as_str();
        // After a sync or conversion of the movie in flight, which would store objects after it.
        let _turn = crate::lock_movie(id).await;
        let deleted = crate::remove_movie_images(&self.objects, id).await?;
        tracing::info!(movie_id = id, deleted, "images of a deleted movie removed");
        Ok(())
    }
}
