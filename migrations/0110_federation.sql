-- Federation: each local user's key pair, where remote followers receive deliveries, the state
-- of local users' follows of remote actors, and what the inbox has already taken in.
--
-- Upgrade: existing users get their key pair from the write service at start-up (SQL cannot
-- generate RSA keys); existing remote followers have no inbox recorded and are skipped by
-- deliveries until they follow again; existing follows of remote actors count as accepted.

-- The private key is PKCS#8 DER and never leaves the write service except as a signature.
CREATE TABLE actor_keys (
    user_id         TEXT PRIMARY KEY NOT NULL REFERENCES users (id),
    private_key     BLOB NOT NULL,
    public_key_pem  TEXT NOT NULL,
    created_at      INTEGER NOT NULL
);

ALTER TABLE remote_followers ADD COLUMN inbox TEXT;
ALTER TABLE remote_followers ADD COLUMN shared_inbox TEXT;

-- A local user's follow of a remote actor: the `Followed` event our Follow activity's id derives
-- from, and when the actor accepted it.
ALTER TABLE follows ADD COLUMN follow_event_id TEXT;
ALTER TABLE follows ADD COLUMN accepted_at INTEGER;
UPDATE follows SET accepted_at = created_at WHERE target LIKE 'actor:%';

-- Activities queued for delivery, once each (the id derives from the event that caused it).
CREATE TABLE federation_outbox (
    activity_id  TEXT PRIMARY KEY NOT NULL,
    queued       INTEGER NOT NULL,
    created_at   INTEGER NOT NULL
);

-- Activities the inbox has taken in: a repeat delivery changes nothing.
CREATE TABLE federation_inbox (
    activity_id  TEXT PRIMARY KEY NOT NULL,
    received_at  INTEGER NOT NULL
);
