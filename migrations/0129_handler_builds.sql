-- The builds of each handler that claim on the db backend, told apart by the event types their
-- claims name (sorted, comma-separated). During a rolling update two builds of a handler can
-- claim at once; only the one that began claiming last is handed anything, the other stands
-- by, so rows of a type only the newer build takes are never passed over by the older one.
-- A build is live while it has claimed within the lease.
CREATE TABLE handler_builds (
    handler      TEXT NOT NULL,
    event_types  TEXT NOT NULL,
    first_seen   INTEGER NOT NULL,
    last_seen    INTEGER NOT NULL,
    PRIMARY KEY (handler, event_types)
) WITHOUT ROWID;
