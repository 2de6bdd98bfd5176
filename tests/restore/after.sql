-- Restore test, step 3, on each restored database (a new cluster, whose transaction ids are
-- far behind the dumped cluster's), and on the database pg_upgrade carried to a newer
-- PostgreSQL (scripts/rig, run_pg_upgrade_test): each group is handed what it had not
-- resolved, once this cluster's producers allow, also while producers keep overlapping; nothing
-- it acknowledged comes again; each role may do what its own grants allow, and only that.
\set ON_ERROR_STOP on
\set QUIET on
-- A producer of the stream is open (prepared, so this session goes on).
BEGIN;
SET LOCAL sqlstreams.notify = off;  -- a transaction to prepare must not notify
SELECT sqlstreams.produce('restore.orders', '{"n": 25}');
PREPARE TRANSACTION :'first';
-- shipping proved 20 before the dump; its retries of 1 and 2 are an hour away; 21-24 wait
-- for the open producer, which may hold any id up to 25 here.
SELECT coalesce(array_agg(message_id ORDER BY message_id)::text, '{}') AS got FROM sqlstreams.claim('restore.orders', 'shipping', 100) \gset
SELECT :'got' = '{11,12,13,14,15,16,17,18,19,20}' AS ok \gset
\if :ok
\else
    \echo shipping got :got
    DO $$ BEGIN RAISE 'shipping was not handed 11-20'; END $$;
\endif
-- billing had resolved 1-20 and stored an observation of 24 with the dumped cluster's
-- transaction id: on a new cluster that id proves nothing, and billing waits for the open
-- producer too. After pg_upgrade (`-v upgraded=1`: the rig's pg_upgrade test) the cluster's
-- transaction ids go on, every transaction before that one has ended, and 21-24 are proven.
\if :{?upgraded}
    \set billing_now '{21,22,23,24}'
    \set billing_then '{25}'
\else
    \set billing_now '{}'
    \set billing_then '{21,22,23,24,25}'
\endif
SELECT coalesce(array_agg(message_id ORDER BY message_id)::text, '{}') AS got FROM sqlstreams.claim('restore.orders', 'billing', 100) \gset
SELECT :'got' = :'billing_now' AS ok \gset
\if :ok
\else
    \echo billing got :got
    DO $$ BEGIN RAISE 'billing was not handed what its fence proves while a producer that may hold later ids was open'; END $$;
\endif
-- Producers overlap: a second one opens, then the first commits.
BEGIN;
SET LOCAL sqlstreams.notify = off;
SELECT sqlstreams.produce('restore.orders', '{"n": 26}');
PREPARE TRANSACTION :'second';
COMMIT PREPARED :'first';
SELECT coalesce(array_agg(message_id ORDER BY message_id)::text, '{}') AS got FROM sqlstreams.claim('restore.orders', 'billing', 100) \gset
SELECT :'got' = :'billing_then' AS ok \gset
\if :ok
\else
    \echo billing got :got
    DO $$ BEGIN RAISE 'billing was not handed the rest of 21-25 while a later producer was open'; END $$;
\endif
COMMIT PREPARED :'second';
SELECT coalesce(array_agg(message_id ORDER BY message_id)::text, '{}') AS got FROM sqlstreams.claim('restore.orders', 'shipping', 100) \gset
SELECT :'got' = '{21,22,23,24,25,26}' AS ok \gset
\if :ok
\else
    \echo shipping then got :got
    DO $$ BEGIN RAISE 'shipping was not handed 21-26 once the producers committed'; END $$;
\endif
-- The grants went to the roles of the same names, and only the grants of roles that exist.
-- pg_upgrade copies the table as it is, roles' ids too: the grant of the role dropped on the old
-- cluster stays there, naming no role, as it did.
\if :{?upgraded}
    \set grants 4
\else
    \set grants 3
\endif
SELECT count(*) = :grants AS ok FROM sqlstreams.stream_grant \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the restore kept a grant of a role dropped before the dump'; END $$;
\endif
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
SELECT sqlstreams.produce('restore.orders', '{"n": 27}');
RESET ROLE;
