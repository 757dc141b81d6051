-- A year's wrap-up can be made again. Until now (user, year) had one wrap-up for ever, so the
-- current year's, asked for in June, still showed June's figures in December, and a diary
-- back-filled with entries of a past year never reached its wrap-up. Now asking again makes a
-- new wrap-up when the year's diary (its entries, and their films' enrichment) is no longer
-- what the newest one was computed from; the older ones stay readable by their ids.
--   * inputs_digest: SHA-256 of the inputs the completed figures were computed from, as
--     GetWrapUpInputs gave them to the handler (NULL before it is known: such a wrap-up is made
--     again on the next ask);
--   * previous_id: the wrap-up of the same user and year this one replaces;
--   * at most one wrap-up of a user and year is generating at a time.
-- SQLite cannot drop the old UNIQUE (user_id, year), so the table is rebuilt; nothing refers
-- to it.
CREATE TABLE wrap_ups_new (
    id                 TEXT PRIMARY KEY NOT NULL,
    user_id            TEXT NOT NULL REFERENCES users (id),
    year               INTEGER NOT NULL,
    status             TEXT NOT NULL,
    summary_json       TEXT NOT NULL DEFAULT '',
    requested_at       INTEGER NOT NULL,
    completed_at       INTEGER,
    summary            BLOB,
    card_key           TEXT,
    card_content_type  TEXT,
    request_event_id   TEXT,
    inputs_digest      TEXT,
    previous_id        TEXT
);
INSERT INTO wrap_ups_new (id, user_id, year, status, summary_json, requested_at, completed_at, summary,
                          card_key, card_content_type, request_event_id)
    SELECT id, user_id, year, status, summary_json, requested_at, completed_at, summary,
           card_key, card_content_type, request_event_id
    FROM wrap_ups ORDER BY rowid;
DROP TABLE wrap_ups;
ALTER TABLE wrap_ups_new RENAME TO wrap_ups;
-- The newest of a user's year is the last inserted (rowid order, kept by the copy above; wrap-ups
-- are never deleted), not the latest `requested_at`, which a wall clock stepping back misorders.
CREATE INDEX wrap_ups_user_year ON wrap_ups (user_id, year);
CREATE UNIQUE INDEX wrap_ups_generating ON wrap_ups (user_id, year) WHERE status = 'generating';
