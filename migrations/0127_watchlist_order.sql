-- A watchlist lists in the order its movies were added (then by movie id, for ties in one
-- millisecond), read page by page through this index.
CREATE INDEX watchlist_user_added ON watchlist (user_id, added_at, movie_id);
