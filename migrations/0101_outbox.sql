-- The DB bus becomes the transactional outbox.
--   * event_id: UUID, the dedup key for the broker and the ledger. Nullable so foreign writers
--     keep working, unique when set; every existing row gets a fresh random UUID here.
--   * claimed_at: when a relay or consumer claimed the row, so a dead claimer's rows are
--     reclaimed after the lease.
--   * processed_events: the per-(event, handler) ledger; started_at (ms) is the owner token.

ALTER TABLE event_queue ADD COLUMN event_id TEXT;
ALTER TABLE event_queue ADD COLUMN claimed_at INTEGER;

-- A random version-4 UUID per row (randomblob is evaluated once per row).
UPDATE event_queue
SET event_id =
        lower(hex(randomblob(4))) || '-' ||
        lower(hex(randomblob(2))) || '-4' ||
        substr(lower(hex(randomblob(2))), 2) || '-' ||
        substr('89ab', 1 + (abs(random()) % 4), 1) ||
        substr(lower(hex(randomblob(2))), 2) || '-' ||
        lower(hex(randomblob(6)))
WHERE event_id IS NULL;

CREATE UNIQUE INDEX event_queue_event_id ON event_queue (event_id) WHERE event_id IS NOT NULL;

CREATE TABLE processed_events (
    event_id      TEXT NOT NULL,
    handler       TEXT NOT NULL,
    -- in_progress | done
    status        TEXT NOT NULL,
    started_at    INTEGER NOT NULL,
    processed_at  INTEGER,
    PRIMARY KEY (event_id, handler)
) WITHOUT ROWID;
CREATE INDEX processed_events_done ON processed_events (processed_at) WHERE status = 'done';
