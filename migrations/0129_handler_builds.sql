-- The builds of each handler, told apart by the event types they take (sorted, comma-separated),
-- as their claims name them (db claims, and nats ledger claims). During a rolling update two
-- builds of a handler can run at once; only the one first heard from last is handed anything,
-- the other stands by, so rows (or messages) of a type only the newer build takes are never
-- passed over (or acked) by the older one. A build is live while it was heard from within four
-- claim leases (idle claimers tell it every quarter lease); first_seen is never reset.
CREATE TABLE handler_builds (
    handler      TEXT NOT NULL,
    event_types  TEXT NOT NULL,
    first_seen   INTEGER NOT NULL,
    last_seen    INTEGER NOT NULL,
    PRIMARY KEY (handler, event_types)
) WITHOUT ROWID;
