//! The wrap-up handler (on `WrapUpRequested`): resumes the `Generating` wrap-up, computes the
//! user's year in film from the diary and the films' enrichment (films and hours watched,
//! rewatches, ratings, top genres and directors, month by month, highest rated), draws it as a
//! card stored in object storage, then completes the wrap-up through `WrapUps.CompleteWrapUp`,
//! atomically, so `WrapUpCompleted` is raised once. A wrap-up already completed is left alone;
//! the figures and the card are deterministic, so a redelivery redraws the same object. The
//! completion carries the digest of the inputs the figures came from: asking for the year again
//! once the diary differs from them makes a new wrap-up.

pub mod card;
pub mod figures;

use std::sync::Arc;

use bytes::Bytes;
use reelay_contracts::v1::{self, event::Payload, wrap_ups_client::WrapUpsClient};
use reelay_delivery::{BuiltHandler, Handler, HandlerContext, HandlerError};
use reelay_kit::client::ServiceChannel;
use reelay_objects::Objects;
use tonic::Code;

/// Builds `wrap-up`, storing cards in `objects`.
pub fn build(context: &HandlerContext, objects: Objects) -> BuiltHandler {
    // A heavy year's inputs come in one answer, larger than other calls' may be: the write
    // service bounds it (the larger of its REELAY_GRPC_MAX_MESSAGE_BYTES and
    // WRAP_UP_INPUTS_MAX_BYTES), which this process's setting need not match.
    let wrap_ups = WrapUpsClient::new(context.write.clone()).max_decoding_message_size(usize::MAX);
    let handler = WrapUp { wrap_ups, objects };
    BuiltHandler { handler: Arc::new(handler), grpc: None }
}

/// Where a wrap-up's card drawn from the inputs of digest `inputs_digest` is stored: two runs
/// of one wrap-up on different inputs (the diary changed between them) write two cards, and the
/// one that completes the wrap-up names its own, never the other's.
pub fn card_key(wrap_up_id: &str, inputs_digest: &str) -> String {
    match inputs_digest.get(..16) {
        Some(digest) => format!("wrapups/{wrap_up_id}/card-{digest}.svg"),
        // From a write service that gives no digest.
        None => format!("wrapups/{wrap_up_id}/card.svg"),
    }
}

pub struct WrapUp {
    wrap_ups: WrapUpsClient<ServiceChannel>,
    objects: Objects,
}

#[async_trait::async_trait]
impl Handler for WrapUp {
    fn name(&self) -> &'static str {
        "wrap-up"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["WrapUpRequested"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::WrapUpRequested(requested)) = &event.payload else { return Ok(()) };
        let request = v1::GetWrapUpInputsRequest { wrap_up_id: requested.wrap_up_id.clone() };
        let inputs = match self.wrap_ups.clone().get_wrap_up_inputs(request).await {
            Ok(inputs) => inputs.into_inner(),
            Err(status) if status.code() == Code::NotFound => return Ok(()),
            Err(status) => return Err(HandlerError::from_call("GetWrapUpInputs", &status)),
        };
        let wrap_up = inputs.wrap_up.unwrap_or_default();
        if wrap_up.status == v1::WrapUpStatus::Completed as i32 {
            return Ok(());
        }
        let summary = figures::summarize(&inputs.entries);
        let key = card_key(&wrap_up.wrap_up_id, &inputs.inputs_digest);
        let svg = card::render(wrap_up.year, &summary);
        self.objects.put(&key, Bytes::from(svg)).await.map_err(|e| {
            HandlerError::retryable_or_unavailable(format!("storing the card: {e}"), e.store_unavailable())
        })?;
        let complete = v1::CompleteWrapUpRequest {
            wrap_up_id: wrap_up.wrap_up_id.clone(),
            summary: Some(summary),
            card_key: key,
            card_content_type: card::CONTENT_TYPE.into(),
            inputs_digest: inputs.inputs_digest.clone(),
        };
        let done = self
            .wrap_ups
            .clone()
            .complete_wrap_up(complete)
            .await
            .map_err(|s| HandlerError::from_call("CompleteWrapUp", &s))?
            .into_inner();
        tracing::info!(wrap_up_id = %wrap_up.wrap_up_id, year = wrap_up.year, entries = inputs.entries.len(),
            changed = done.changed, "wrap-up completed");
        Ok(())
    }
}
