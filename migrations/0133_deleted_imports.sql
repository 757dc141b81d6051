-- The import keys of imported diary entries their users deleted: a later import of the same
-- export (or a newer one) skips them, as it skips entries still there, instead of bringing
-- them back. Keys are per user (`<user id>|letterboxd:<entry>`), as `reviews.import_key`.
CREATE TABLE deleted_imports (
    import_key  TEXT PRIMARY KEY NOT NULL,
    deleted_at  INTEGER NOT NULL
) WITHOUT ROWID;
