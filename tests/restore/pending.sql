-- Restore test, step 2: a claim of billing (which has resolved 1-20) while a producer of the
-- stream is open (a prepared transaction) finds nothing it may hand out and stores a fence
-- observation to prove later, with this cluster's transaction id. The producer then commits;
-- the dump is taken after.
\set ON_ERROR_STOP on
\set QUIET on
BEGIN;
SET LOCAL sqlstreams.notify = off;  -- a transaction to prepare must not notify
SELECT sqlstreams.produce('restore.orders', '{"n": 21}');
PREPARE TRANSACTION 'restore_producer';
SELECT sqlstreams.produce('restore.orders', jsonb_build_object('n', n)) FROM generate_series(22, 24) n;
SELECT count(*) AS handed_out FROM sqlstreams.claim('restore.orders', 'billing', 100) \gset
COMMIT PREPARED 'restore_producer';
SELECT :handed_out = 0 AND c.fence_head = 24 AS ok
FROM sqlstreams.cursor_1 c JOIN sqlstreams.consumer_group g ON g.id = c.consumer_group_id AND g.name = 'billing' \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'billing did not store a pending fence observation for 24 with nothing handed out'; END $$;
\endif
