-- Activity ids and note ids are chosen by the sending server, and every actor there can sign
-- with any id on it. Keyed by id alone, one actor could send an activity under an id another
-- actor of the same server will use (Mastodon's account Delete is `<actor>#delete`, known in
-- advance) and make that later activity a repeat, never taken in; or delete a colleague's note
-- before it arrives and keep it out. Both records are now the actor's own: an activity is a
-- repeat only when the same actor sent it, and a note is kept out only by its own author's
-- Delete. Records from before have no actor (''), count as any actor's, and go with retention.
CREATE TABLE federation_inbox_by_actor (
    activity_id  TEXT NOT NULL,
    actor_uri    TEXT NOT NULL,
    received_at  INTEGER NOT NULL,
    PRIMARY KEY (activity_id, actor_uri)
);
INSERT INTO federation_inbox_by_actor (activity_id, actor_uri, received_at)
    SELECT activity_id, '', received_at FROM federation_inbox;
DROP TABLE federation_inbox;
ALTER TABLE federation_inbox_by_actor RENAME TO federation_inbox;
CREATE INDEX federation_inbox_received ON federation_inbox (received_at);

CREATE TABLE remote_review_tombstones_by_actor (
    object_uri  TEXT NOT NULL,
    actor_uri   TEXT NOT NULL,
    deleted_at  INTEGER NOT NULL,
    PRIMARY KEY (object_uri, actor_uri)
);
INSERT INTO remote_review_tombstones_by_actor (object_uri, actor_uri, deleted_at)
    SELECT object_uri, actor_uri, deleted_at FROM remote_review_tombstones;
DROP TABLE remote_review_tombstones;
ALTER TABLE remote_review_tombstones_by_actor RENAME TO remote_review_tombstones;
CREATE INDEX remote_review_tombstones_deleted ON remote_review_tombstones (deleted_at);
