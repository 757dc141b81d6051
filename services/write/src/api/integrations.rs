//! The Integrations service: importing a Letterboxd export streamed in chunks.

use reelay_contracts::v1;
use reelay_domain::letterboxd;
use reelay_kit::ServiceError;
use tonic::{Code, Request, Status, Streaming};

use super::{Reply, WriteApi, ok};
use crate::convert;
use crate::request_ids::RequestKey;

/// The largest Letterboxd export accepted (the file, summed over its chunks).
pub const MAX_IMPORT_BYTES: usize = 32 * 1024 * 1024;

#[tonic::async_trait]
impl v1::integrations_server::Integrations for WriteApi {
    async fn import_diary(&self, request: Request<Streaming<v1::ImportDiaryChunk>>) -> Reply<v1::ImportDiaryResponse> {
        let mut stream = request.into_inner();
        let mut actor = None;
        let mut request_id = String::new();
        let mut data = Vec::new();
        while let Some(chunk) = stream.message().await.map_err(unreadable_chunk)? {
            if actor.is_none() {
                actor = Some(convert::actor(&chunk.actor_user_id).map_err(ServiceError::from)?);
                request_id = chunk.request_id;
            }
            if data.len() + chunk.data.len() > MAX_IMPORT_BYTES {
                return Err(ServiceError::invalid(
                    "data",
                    format!("the export is larger than {MAX_IMPORT_BYTES} bytes"),
                )
                .into());
            }
            data.extend_from_slice(&chunk.data);
        }
        let actor =
            actor.ok_or_else(|| ServiceError::invalid("actor_user_id", "is required (the stream was empty)"))?;
        let key = RequestKey::from_parts(
            "ImportDiary",
            &actor.to_string(),
            &request_id,
            &[actor.to_string().as_bytes(), &data],
        )?;
        if data.is_empty() {
            return Err(ServiceError::invalid("data", "is required (the export was empty)").into());
        }
        // Validate the whole file before writing anything.
        let parsed = tokio::task::spawn_blocking(move || letterboxd::parse_diary(&data, reelay_kit::now_ms()))
            .await
            .map_err(|_| ServiceError::internal("the CSV parser failed unexpectedly"))?
            .map_err(ServiceError::from)?;
        if !self.store.user_exists(actor).await? {
            return Err(ServiceError::not_found(format_args!("user {actor}")).into());
        }
        let import_id = uuid::Uuid::now_v7().to_string();
        let without_year = parsed.without_year.len() as u32;
        let answer = self.store.import_diary(actor, import_id, parsed.rows, without_year, key).await?;
        tracing::info!(import_id = %answer.import_id, user = %actor, rows = answer.rows, imported = answer.imported,
            skipped = answer.skipped_duplicates, without_year, "diary imported");
        ok(answer)
    }
}

/// A chunk the stream could not deliver: a chunk that does not decode or is over the size limit
/// is the caller's error, as it is for a unary request (see the server's `blame_the_request`).
fn unreadable_chunk(status: Status) -> Status {
    match status.code() {
        Code::OutOfRange => Status::resource_exhausted(format!("a chunk could not be read: {}", status.message())),
        Code::Internal if status.message().starts_with("failed to decode") => {
            Status::invalid_argument(format!("a chunk could not be read: {}", status.message()))
        }
        _ => status,
    }
}
