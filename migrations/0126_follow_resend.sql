-- A local user's follow of a remote actor still waiting for its Accept can be asked again (the
-- delivery of its Follow may have been given up): the Follow is sent again under its own id, and
-- this is when it last was (NULL: when the follow was made, `created_at`).
ALTER TABLE follows ADD COLUMN follow_sent_at INTEGER;
