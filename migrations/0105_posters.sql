-- Posters and images (issue 11).
--   * movie_posters: one row per stored poster size of a movie ("original", later "w92",
--     "w185", ...), with its object key, content type, size and SHA-256 of the bytes. The
--     "original" row is written by Movies/RecordPoster (the poster-sync handler) together with
--     PosterSynced and ImageStored; a repeat with the same key and digest changes nothing.
--     Rows go with their movie.

CREATE TABLE movie_posters (
    movie_id      TEXT NOT NULL REFERENCES movies (id) ON DELETE CASCADE,
    size          TEXT NOT NULL,
    object_key    TEXT NOT NULL,
    content_type  TEXT NOT NULL,
    size_bytes    INTEGER NOT NULL,
    sha256        TEXT NOT NULL,
    source_url    TEXT NOT NULL DEFAULT '',
    stored_at     INTEGER NOT NULL,
    PRIMARY KEY (movie_id, size)
) WITHOUT ROWID;
