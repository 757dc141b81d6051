-- The domain schema: users, movies, the diary, watchlists, wrap-ups, the social graph and what
-- federation brings in. All timestamps are milliseconds since the Unix epoch.

CREATE TABLE users (
    id            TEXT PRIMARY KEY NOT NULL,
    handle        TEXT NOT NULL UNIQUE,
    display_name  TEXT NOT NULL,
    created_at    INTEGER NOT NULL
);

CREATE TABLE movies (
    id           TEXT PRIMARY KEY NOT NULL,
    title        TEXT NOT NULL,
    -- Lower-cased, whitespace-folded title: the identity of a movie together with its year.
    title_key    TEXT NOT NULL,
    year         INTEGER NOT NULL,
    external_id  TEXT UNIQUE,
    created_at   INTEGER NOT NULL,
    UNIQUE (title_key, year)
);

CREATE TABLE reviews (
    id          TEXT PRIMARY KEY NOT NULL,
    user_id     TEXT NOT NULL REFERENCES users (id),
    movie_id    TEXT NOT NULL REFERENCES movies (id),
    rating      INTEGER NOT NULL,
    body        TEXT NOT NULL,
    watched_on  TEXT NOT NULL DEFAULT '',
    rewatch     INTEGER NOT NULL DEFAULT 0,
    source      TEXT NOT NULL,
    -- Identity of an imported diary entry, so a re-import skips it.
    import_key  TEXT UNIQUE,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL
);
CREATE INDEX reviews_user ON reviews (user_id, id);
CREATE INDEX reviews_movie ON reviews (movie_id);

CREATE TABLE watchlist (
    user_id   TEXT NOT NULL REFERENCES users (id),
    movie_id  TEXT NOT NULL REFERENCES movies (id),
    added_at  INTEGER NOT NULL,
    PRIMARY KEY (user_id, movie_id)
);
CREATE INDEX watchlist_movie ON watchlist (movie_id);

CREATE TABLE wrap_ups (
    id            TEXT PRIMARY KEY NOT NULL,
    user_id       TEXT NOT NULL REFERENCES users (id),
    year          INTEGER NOT NULL,
    status        TEXT NOT NULL,
    summary_json  TEXT NOT NULL DEFAULT '',
    requested_at  INTEGER NOT NULL,
    completed_at  INTEGER,
    UNIQUE (user_id, year)
);

-- `target` is 'user:<uuid>' for a local account or 'actor:<uri>' for a remote one.
CREATE TABLE follows (
    follower_id  TEXT NOT NULL REFERENCES users (id),
    target       TEXT NOT NULL,
    created_at   INTEGER NOT NULL,
    PRIMARY KEY (follower_id, target)
);
CREATE INDEX follows_target ON follows (target);

CREATE TABLE blocks (
    blocker_id  TEXT NOT NULL REFERENCES users (id),
    target      TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (blocker_id, target)
);

-- Remote ActivityPub actors following a local user.
CREATE TABLE remote_followers (
    user_id       TEXT NOT NULL REFERENCES users (id),
    actor_uri     TEXT NOT NULL,
    activity_uri  TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (user_id, actor_uri)
);

CREATE TABLE remote_reviews (
    id            TEXT PRIMARY KEY NOT NULL,
    object_uri    TEXT NOT NULL UNIQUE,
    actor_uri     TEXT NOT NULL,
    movie_id      TEXT NOT NULL REFERENCES movies (id),
    rating        INTEGER NOT NULL,
    body          TEXT NOT NULL,
    published_at  INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);
CREATE INDEX remote_reviews_movie ON remote_reviews (movie_id);
