-- Each (event, handler) gets its own delivery state on the db backend, and every claim a lease
-- that its owner renews while it works.
--
-- Writes still add one outbox row per event, whatever the number of handlers. Each handler has a
-- cursor into the outbox: every row up to `position` has been handed to it (or is not of a type
-- it takes). Handing a row over creates the handler's row in `processed_events`, which already
-- was the per-(event, handler) ledger and now also carries the delivery state:
--   in_progress    claimed; `started_at` is the owner's token, `renewed_at` its last sign of life
--   retry          failed (or handed back); due again at `available_at`
--   done           handled
--   dead_lettered  given up after EVENT_QUEUE_MAX_ATTEMPTS (or a permanent failure): `last_error`
-- `attempts` counts failed deliveries of that event to that handler alone.
--
-- `owner` names the claimer (`<instance>#<incarnation>`), so a restarted process can take back
-- the claims its dead predecessor held at once instead of waiting out their leases. The relay's
-- row claims in `event_queue` get the same (`claimed_by`).
--
-- Upgrade: existing rows keep their meaning. Pending and processing outbox rows are delivered to
-- every handler (a handler whose ledger row is `done` skips them); done and dead-lettered rows
-- are not delivered again. `delivery_floor` is where a handler's cursor starts when the first
-- cursors are created: just before the oldest row not yet settled.

ALTER TABLE processed_events ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE processed_events ADD COLUMN available_at INTEGER;
ALTER TABLE processed_events ADD COLUMN last_error TEXT;
ALTER TABLE processed_events ADD COLUMN renewed_at INTEGER;
ALTER TABLE processed_events ADD COLUMN owner TEXT;
UPDATE processed_events SET renewed_at = started_at;

-- The open claims and retries of one handler: small, scanned by every claim.
CREATE INDEX processed_events_open ON processed_events (handler, status) WHERE status IN ('in_progress', 'retry');
CREATE INDEX processed_events_dead ON processed_events (handler) WHERE status = 'dead_lettered';

ALTER TABLE event_queue ADD COLUMN claimed_by TEXT;

CREATE TABLE handler_cursors (
    handler     TEXT PRIMARY KEY NOT NULL,
    position    INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE outbox_meta (
    key    TEXT PRIMARY KEY NOT NULL,
    value  INTEGER NOT NULL
) WITHOUT ROWID;

INSERT INTO outbox_meta (key, value)
VALUES (
    'delivery_floor',
    COALESCE(
        (SELECT MIN(id) - 1 FROM event_queue WHERE status IN ('pending', 'processing')),
        (SELECT MAX(id) FROM event_queue),
        0
    )
);
