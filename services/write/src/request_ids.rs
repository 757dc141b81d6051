//! Client idempotency keys (`request_id`). A write that carries one records its answer in the
//! same transaction as the write; a retry with the same key gets that answer back and writes
//! nothing. This is how a caller recovers from an answer it never received or an "outcome
//! unknown": it retries with the same key and learns what happened, at most once.
//!
//! Keys are scoped by method and by the acting user (`actor_user_id`, where the method has one):
//! two users' clients counting their keys from 1 do not collide. A key reused for a different
//! request (another fingerprint) is refused rather than answered with someone else's result. Keys are kept for a bounded time
//! and purged in small batches.

use prost::Message;
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;
use sqlx::Row;

use crate::WriteError;

/// The longest `request_id` accepted.
const MAX_LEN: usize = 128;

/// One call's idempotency key: the method, the caller's `request_id` and a fingerprint of the
/// request itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKey {
    method: &'static str,
    /// The caller's `request_id`, as sent (what messages name).
    request_id: String,
    /// What it is stored under: `<actor>/<request_id>` for a method with an actor.
    stored: String,
    fingerprint: String,
}

impl RequestKey {
    /// The key of a call, or `None` when it carries no `request_id`. `request` must be the
    /// request with its `request_id` cleared, so the fingerprint names what was asked.
    /// `actor`: the acting user as the request names it (empty for a method without one).
    pub fn of<M: Message>(
        method: &'static str,
        actor: &str,
        request_id: &str,
        request: &M,
    ) -> Result<Option<Self>, ServiceError> {
        Self::from_parts(method, actor, request_id, &[&request.encode_to_vec()])
    }

    /// Like [`RequestKey::of`], for a request that arrives in parts (a streamed import).
    pub fn from_parts(
        method: &'static str,
        actor: &str,
        request_id: &str,
        parts: &[&[u8]],
    ) -> Result<Option<Self>, ServiceError> {
        if request_id.is_empty() {
            return Ok(None);
        }
        let valid = request_id.len() <= MAX_LEN
            && request_id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
        if !valid {
            return Err(ServiceError::invalid(
                "request_id",
                format!("must be 1-{MAX_LEN} of A-Z a-z 0-9 . _ : -, got {:?}", truncate(request_id)),
            ));
        }
        let fingerprint = sha256_of_parts(method.as_bytes(), parts.iter().copied());
        // A user id in whichever spelling the parser takes (upper case, no hyphens, braces) is
        // one user: keyed under one spelling, a retry spelling it otherwise is the same key
        // (then refused as another request under it) and never a second write.
        let actor = uuid::Uuid::try_parse(actor).map_or_else(|_| actor.to_owned(), |id| id.hyphenated().to_string());
        let stored = if actor.is_empty() { request_id.to_owned() } else { format!("{actor}/{request_id}") };
        Ok(Some(Self { method, request_id: request_id.to_owned(), stored, fingerprint }))
    }

    /// The answer recorded for this key, if the call was made before. Runs inside the write job,
    /// so a concurrent retry waits for the first call's transaction and then sees its answer.
    /// A key [reserved](Self::reserve) by a call still under way (or broken off) answers `None`
    /// to the same request, and is refused to another.
    pub async fn recorded<R: Message + Default>(&self, tx: &mut WriteTx) -> Result<Option<R>, WriteError> {
        let lookup = |stored: &str| {
            sqlx::query("SELECT fingerprint, response, pending FROM request_ids WHERE method = ? AND request_id = ?")
                .bind(self.method)
                .bind(stored.to_owned())
        };
        let mut row = lookup(&self.stored).fetch_optional(tx.conn()).await?;
        if row.is_none() && self.stored != self.request_id {
            // Recorded before keys were scoped by actor (within the retention since the
            // upgrade): the same actor's only, since the fingerprint covers the actor.
            row = lookup(&self.request_id)
                .fetch_optional(tx.conn())
                .await?
                .filter(|r| r.get::<String, _>(0) == self.fingerprint);
        }
        let Some(row) = row else { return Ok(None) };
        if row.get::<String, _>(0) != self.fingerprint {
            return Err(ServiceError::invalid(
                "request_id",
                format!("{:?} was already used for a different {} request", self.request_id, self.method),
            )
            .into());
        }
        if row.get::<bool, _>(2) {
            return Ok(None);
        }
        let response = R::decode(row.get::<Vec<u8>, _>(1).as_slice()).map_err(|e| {
            ServiceError::internal(format!("the answer recorded for a request_id does not decode: {e}"))
        })?;
        tracing::info!(method = self.method, request_id = %self.request_id, "repeated request answered from its first call");
        Ok(Some(response))
    }

    /// Takes the key for a call written in several transactions (a streamed import's chunks),
    /// in its first one, after [`recorded`](Self::recorded) found nothing: another request under
    /// it is refused from then on, before it writes anything. Taken already (a retry of the same
    /// request), it stays as it is.
    pub async fn reserve(&self, tx: &mut WriteTx) -> Result<(), WriteError> {
        sqlx::query(
            "INSERT INTO request_ids (method, request_id, fingerprint, response, created_at, pending) \
             VALUES (?, ?, ?, x'', ?, 1) ON CONFLICT (method, request_id) DO NOTHING",
        )
        .bind(self.method)
        .bind(&self.stored)
        .bind(&self.fingerprint)
        .bind(tx.now_ms())
        .execute(tx.conn())
        .await?;
        Ok(())
    }

    /// Records the answer of the call that just wrote, in its transaction (in place of its
    /// reservation, if it made one).
    pub async fn record<R: Message>(&self, tx: &mut WriteTx, response: &R) -> Result<(), WriteError> {
        sqlx::query(
            "INSERT INTO request_ids (method, request_id, fingerprint, response, created_at) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (method, request_id) DO UPDATE SET response = excluded.response, \
             created_at = excluded.created_at, pending = 0",
        )
        .bind(self.method)
        .bind(&self.stored)
        .bind(&self.fingerprint)
        .bind(response.encode_to_vec())
        .bind(tx.now_ms())
        .execute(tx.conn())
        .await?;
        Ok(())
    }
}

/// SHA-256 of `head` and then each of `parts` with its length before it (so no two different
/// lists of parts hash the same bytes), as 64 lowercase hex digits.
pub fn sha256_of_parts<'a>(head: &[u8], parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    digest.update(head);
    for part in parts {
        digest.update(&(part.len() as u64).to_le_bytes());
        digest.update(part);
    }
    digest.finish().as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn truncate(value: &str) -> String {
    value.chars().take(40).collect()
}

/// How long a key taken by an import still under way (pending) is kept at least, whatever the
/// retention: purged sooner, another file could be imported under it meanwhile.
const PENDING_KEPT_MS: i64 = 24 * 3600 * 1000;

/// Deletes up to `batch` keys recorded before `cutoff_ms` (pending ones once a day old as well);
/// returns how many went.
pub async fn purge(tx: &mut WriteTx, cutoff_ms: i64, batch: u32) -> Result<u64, sqlx::Error> {
    let pending_cutoff = cutoff_ms.min(tx.now_ms() - PENDING_KEPT_MS);
    Ok(sqlx::query(
        "DELETE FROM request_ids WHERE (method, request_id) IN \
         (SELECT method, request_id FROM request_ids WHERE created_at < ?1 AND (pending = 0 OR created_at < ?2) \
          LIMIT ?3)",
    )
    .bind(cutoff_ms)
    .bind(pending_cutoff)
    .bind(i64::from(batch))
    .execute(tx.conn())
    .await?
    .rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One user's key, however its id is spelled.
    #[test]
    fn a_user_id_keys_alike_in_every_spelling() {
        let request = reelay_contracts::v1::GetUserRequest::default();
        let key = |actor: &str| RequestKey::of("LogReview", actor, "k1", &request).unwrap().unwrap().stored;
        let id = "01a242f5-6b87-7089-b22a-188c0639a9c6";
        for spelling in [id.to_uppercase(), id.replace('-', ""), format!("{{{id}}}"), format!("urn:uuid:{id}")] {
            assert_eq!(key(&spelling), key(id), "{spelling}");
        }
        assert_eq!(key(""), "k1");
    }
}
