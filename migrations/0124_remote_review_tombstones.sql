-- Remote reviews their authors deleted.
--
-- Deliveries from another server come in any order: a Delete retried sooner than the Create it
-- follows (the receiving inbox was down for both) arrives first, finds nothing, and the Create
-- that comes after would bring the deleted review back for good. A Delete leaves its object's id
-- here, found or not, and a Create or Update of that id is taken in as a repeat (nothing saved).
-- Kept like the activity dedup tables: not purged yet.
CREATE TABLE remote_review_tombstones (
    object_uri  TEXT PRIMARY KEY NOT NULL,
    actor_uri   TEXT NOT NULL,
    deleted_at  INTEGER NOT NULL
);
