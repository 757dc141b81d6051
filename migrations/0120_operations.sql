-- Operating Reelay: dead letters an operator can replay or discard (recorded), where JetStream
-- stored each event, replays on the nats backend, and retention of finished outbox rows.
--
--   * processed_events.replays: how often an operator replayed this (event, handler); a replay
--     on the nats backend is republished with the message id `<event id>:replay:<n>:<handler>`,
--     so each replay is published once however often the relay retries it.
--   * processed_events.status may now also be `discarded`: an operator gave the dead letter up;
--     it counts as settled (never delivered again) and is purged like a done row.
--   * event_queue.stream_sequence: the JetStream sequence the relay's PubAck named (nats).
--   * event_queue.replay_of / replay_handler: a replay row (nats backend) republishes the event
--     `replay_of` to one handler's replay subject only. The db backend never writes them: its
--     replay makes the handler's delivery due again.
--   * dead_letter_actions: every replay and discard, who asked and what it changed.

ALTER TABLE processed_events ADD COLUMN replays INTEGER NOT NULL DEFAULT 0;

ALTER TABLE event_queue ADD COLUMN stream_sequence INTEGER;
ALTER TABLE event_queue ADD COLUMN replay_of TEXT;
ALTER TABLE event_queue ADD COLUMN replay_handler TEXT;

-- Retention deletes done rows oldest first (nats); explain finds a replay's rows by event.
CREATE INDEX event_queue_created ON event_queue (created_at);
CREATE INDEX event_queue_replay_of ON event_queue (replay_of) WHERE replay_of IS NOT NULL;
-- Dead letters listed newest first, per handler.
CREATE INDEX processed_events_dead_at ON processed_events (handler, processed_at) WHERE status = 'dead_lettered';

CREATE TABLE dead_letter_actions (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    at         INTEGER NOT NULL,
    -- replay | discard
    action     TEXT NOT NULL,
    event_id   TEXT NOT NULL,
    handler    TEXT NOT NULL,
    -- Who asked (the CLI sends the operator's login name).
    operator   TEXT NOT NULL,
    -- The attempts and last error the dead letter had when it was acted on.
    attempts   INTEGER NOT NULL,
    last_error TEXT
);
CREATE INDEX dead_letter_actions_event ON dead_letter_actions (event_id);
