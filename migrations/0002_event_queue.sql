-- The DB-backed event bus as it stood before the outbox: a queue of events polled by the worker.
-- Kept exactly as deployed; migration 0101 turns it into the outbox.

CREATE TABLE event_queue (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    event_type    TEXT NOT NULL,
    aggregate_id  TEXT NOT NULL DEFAULT '',
    payload       BLOB NOT NULL,
    -- pending | processing | done | dead_lettered
    status        TEXT NOT NULL DEFAULT 'pending',
    attempts      INTEGER NOT NULL DEFAULT 0,
    available_at  INTEGER NOT NULL,
    created_at    INTEGER NOT NULL,
    last_error    TEXT
);
-- Claims walk pending rows in id order; (status, id) keeps that a range scan with no sort.
CREATE INDEX event_queue_status_id ON event_queue (status, id);
