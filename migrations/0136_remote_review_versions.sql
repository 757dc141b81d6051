-- When the author last edited each kept remote review, by its note (`updated`, else `published`):
-- deliveries come in any order, so an Update older than the copy kept is not saved over it.
-- 0 for reviews kept before (any Update replaces them, as before).
ALTER TABLE remote_reviews ADD COLUMN edited_at INTEGER NOT NULL DEFAULT 0;
