-- The servers (host, and port when not the scheme's default) that deliveries failed at, with no
-- answer since. A server failing for REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS (7 days by
-- default), with no gap that long between two failures, turns unavailable (`unavailable_since`):
-- a fan-out to followers leaves its inboxes out, so a dead server stops collecting a dead letter
-- for every activity, but for one delivery every REELAY_FEDERATION_PROBE_EVERY_SECS (an hour),
-- sent as a probe (`probed_at`: the last one queued) and dropped if it fails. An answer from
-- the server, or an activity taken in from it, deletes its row.
CREATE TABLE federation_failing_hosts (
    host               TEXT PRIMARY KEY NOT NULL,
    failing_since      INTEGER NOT NULL,
    last_failure_at    INTEGER NOT NULL,
    failures           INTEGER NOT NULL,
    unavailable_since  INTEGER,
    probed_at          INTEGER
) WITHOUT ROWID;
