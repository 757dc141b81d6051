-- A streamed import commits one transaction per chunk of rows, so its request_id is taken by its
-- first chunk (pending = 1, an empty response) and answered by its last. Another import under
-- the same key with a different file is then refused before it writes a row, even while the
-- first is still running; a retry of the same file goes on past a pending key and imports the
-- rest. Every other method records its answer with its one write (pending = 0).
ALTER TABLE request_ids ADD COLUMN pending INTEGER NOT NULL DEFAULT 0;
