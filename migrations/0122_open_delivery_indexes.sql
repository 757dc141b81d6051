-- Expired claims and due retries are sought, not read one by one.
--
-- Every claim and every look of an idle claimer asks whether a handler has a claim whose lease
-- ran out or a retry that is due. With open deliveries indexed by (handler, status) only, that
-- read each of the handler's open claims from the table: hundreds per handler under load, none
-- of them expired. The open index now ends in renewed_at, so expired claims are one range of it,
-- and retries have an index by due time.
DROP INDEX processed_events_open;
CREATE INDEX processed_events_open ON processed_events (handler, status, renewed_at)
    WHERE status IN ('in_progress', 'retry');
CREATE INDEX processed_events_retry ON processed_events (handler, available_at) WHERE status = 'retry';
