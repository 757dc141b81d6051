-- The WrapUpRequested event a generating wrap-up waits on: when its delivery to the wrap-up
-- handler was given up (dead-lettered or discarded, or the relay's), asking for the wrap-up
-- again raises a new one instead of answering "generating" for ever. NULL for wrap-ups from
-- before it was kept.
ALTER TABLE wrap_ups ADD COLUMN request_event_id TEXT;
