-- Retention reads only what it deletes.
--
-- Discarded dead letters are purged like done rows once past the ledger's retention; without an
-- index of their own, finding them meant reading every row the ledger keeps, once a minute.
CREATE INDEX processed_events_discarded ON processed_events (processed_at) WHERE status = 'discarded';
