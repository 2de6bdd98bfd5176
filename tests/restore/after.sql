-- Restore test, step 3, on each restored database: while a producer of the stream is open (a
-- prepared transaction on this cluster, whose transaction ids are behind the dumped
-- cluster's), each group is handed what it had not resolved and may have, and nothing it
-- acknowledged comes again; each role may do what its own grants allow, and only that.
\set ON_ERROR_STOP on
\set QUIET on
BEGIN;
SET LOCAL sqlstreams.notify = off;  -- a transaction to prepare must not notify
SELECT sqlstreams.produce('restore.orders', '{"n": 25}');
PREPARE TRANSACTION :'prepared';
-- billing's fence observation came from the dumped cluster: 21-24 are proven.
SELECT coalesce(array_agg(message_id ORDER BY message_id)::text, '{}') AS got FROM sqlstreams.claim('restore.orders', 'billing', 100) \gset
SELECT :'got' = '{21,22,23,24}' AS ok \gset
\if :ok
\else
    \echo billing got :got
    DO $$ BEGIN RAISE 'billing was not handed 21-24 while a producer was open'; END $$;
\endif
-- shipping proved 20 before the dump; 21-24 wait for this cluster's producer to end, and its
-- retries of 1 and 2 are an hour away.
SELECT coalesce(array_agg(message_id ORDER BY message_id)::text, '{}') AS got FROM sqlstreams.claim('restore.orders', 'shipping', 100) \gset
SELECT :'got' = '{11,12,13,14,15,16,17,18,19,20}' AS ok \gset
\if :ok
\else
    \echo shipping got :got
    DO $$ BEGIN RAISE 'shipping was not handed 11-20'; END $$;
\endif
COMMIT PREPARED :'prepared';
SELECT coalesce(array_agg(message_id ORDER BY message_id)::text, '{}') AS got FROM sqlstreams.claim('restore.orders', 'shipping', 100) \gset
SELECT :'got' = '{21,22,23,24,25}' AS ok \gset
\if :ok
\else
    \echo shipping then got :got
    DO $$ BEGIN RAISE 'shipping was not handed 21-25 once the producer committed'; END $$;
\endif
-- The grants went to the roles of the same names.
SET ROLE restore_bob;
SELECT count(*) FROM sqlstreams.claim('restore.orders', 'billing', 1);
RESET ROLE;
SET ROLE restore_carol;
SELECT count(*) FROM sqlstreams.claim('restore.audit', 'archiver', 1);
DO $$
BEGIN
    PERFORM sqlstreams.claim('restore.orders', 'billing', 1);
    RAISE 'restore_carol claimed as billing, a grant of restore_bob''s';
EXCEPTION WHEN insufficient_privilege THEN
    NULL;
END
$$;
RESET ROLE;
SET ROLE restore_alice;
SELECT sqlstreams.produce('restore.orders', '{"n": 26}');
RESET ROLE;
