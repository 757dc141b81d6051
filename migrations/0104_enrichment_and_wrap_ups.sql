-- Enrichment and wrap-ups.
--   * movies.enrichment: pending | enriched | not_found; `profile` is the encoded MovieProfile
--     the movie enrichment handler wrote (written last: it marks the movie enriched).
--   * people: one row per person the providers credit, keyed by the provider's id
--     ("tmdb:1032", "catalog:<name>"); `profile` is the encoded Person.
--   * wrap_ups: the computed figures (encoded WrapUpSummary) and the card's object key.

ALTER TABLE movies ADD COLUMN enrichment TEXT NOT NULL DEFAULT 'pending';
ALTER TABLE movies ADD COLUMN profile BLOB;
ALTER TABLE movies ADD COLUMN enriched_at INTEGER;

CREATE TABLE people (
    person_id   TEXT PRIMARY KEY NOT NULL,
    name        TEXT NOT NULL,
    profile     BLOB NOT NULL,
    profiled    INTEGER NOT NULL DEFAULT 0,
    updated_at  INTEGER NOT NULL
) WITHOUT ROWID;

ALTER TABLE wrap_ups ADD COLUMN summary BLOB;
ALTER TABLE wrap_ups ADD COLUMN card_key TEXT;
ALTER TABLE wrap_ups ADD COLUMN card_content_type TEXT;
