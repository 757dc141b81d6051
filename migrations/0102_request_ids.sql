-- Client idempotency keys. A write that carries a request_id records its answer here in the
-- same transaction as the write; a retry with the same request_id (after a timeout, a dropped
-- connection or an "outcome unknown" answer) gets that answer back and writes nothing.
--   * fingerprint: a hash of the request without its request_id, so reusing a key for a
--     different request is refused instead of answered with the wrong result.
--   * response: the encoded gRPC response of the first call.
-- Rows are purged after REELAY_REQUEST_ID_RETENTION_HOURS, in small batches.

CREATE TABLE request_ids (
    method       TEXT NOT NULL,
    request_id   TEXT NOT NULL,
    fingerprint  TEXT NOT NULL,
    response     BLOB NOT NULL,
    created_at   INTEGER NOT NULL,
    PRIMARY KEY (method, request_id)
) WITHOUT ROWID;
CREATE INDEX request_ids_created ON request_ids (created_at);
