-- The federation's records of activities taken in (`federation_inbox`) and queued out
-- (`federation_outbox`), and of remote reviews deleted (`remote_review_tombstones`), only matter
-- while a peer may still retry a delivery (days): retention deletes them after
-- REELAY_FEDERATION_RETENTION_DAYS, oldest first, by these indexes.
CREATE INDEX federation_inbox_received ON federation_inbox (received_at);
CREATE INDEX federation_outbox_created ON federation_outbox (created_at);
CREATE INDEX remote_review_tombstones_deleted ON remote_review_tombstones (deleted_at);
