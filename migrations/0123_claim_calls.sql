-- Each claim names the claimer's call that made it.
--
-- A claim answer can be lost on its way (the caller's deadline passed during a slow commit, the
-- connection dropped, the write service was killed after the commit): the claimer then names
-- that call in its next one, and what the call claimed is handed back to it at once instead of
-- being held against it until the lease runs out. `claim_call` is that call's id (the claimer
-- numbers its calls; with the claimer's `owner`, which carries its incarnation, it names one
-- call), written by every claim of a claim call and NULL for claims made by calls without an id.
-- Kept in the rows rather than in the write service's memory, so a restart of the write service
-- forgets none of it.
--
-- Upgrade: rows claimed before it have no call and wait out their lease as before.
ALTER TABLE processed_events ADD COLUMN claim_call INTEGER;
ALTER TABLE event_queue ADD COLUMN claim_call INTEGER;
