-- A remote actor's reviews and its follows of local users, found by the actor: an account
-- deleted on its server takes both with it, and an Undo of a follow names the actor.
CREATE INDEX remote_reviews_actor ON remote_reviews (actor_uri);
CREATE INDEX remote_followers_actor ON remote_followers (actor_uri);
