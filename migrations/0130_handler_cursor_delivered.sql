-- Whether the write service delivers to the handler: set at each start from its build (or its
-- --handler list). A cursor of a handler it does not deliver to (one removed from the build)
-- holds db outbox retention back until an operator retires the handler.
ALTER TABLE handler_cursors ADD COLUMN delivered INTEGER NOT NULL DEFAULT 1;
