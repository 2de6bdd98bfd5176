-- Restore test, step 1 (scripts/rig test): a database in the states a restore must keep, on
-- the suite's cluster, whose transaction ids are far ahead of a new cluster's. The roles
-- restore_alice, restore_bob and restore_carol exist; sqlstreams_* are granted to them here.
-- Messages have no key: they share lane 0, so every claim below hands out the lowest ids.
\set ON_ERROR_STOP on
\set QUIET on
-- The new cluster the dump goes to starts near transaction 750: make sure this one is far ahead.
DO $$ BEGIN WHILE pg_catalog.pg_current_xact_id()::text::bigint < 20000 LOOP COMMIT; END LOOP; END $$;
CREATE EXTENSION sqlstreams;
GRANT sqlstreams_producer TO restore_alice;
GRANT sqlstreams_consumer TO restore_bob, restore_carol;

SELECT sqlstreams.create_stream('restore.orders');
SELECT sqlstreams.create_stream('restore.audit');
SELECT sqlstreams.create_group('restore.orders', 'billing', max_retries => 0);
SELECT sqlstreams.create_group('restore.orders', 'shipping', backoff_base => '1 hour', backoff_cap => '1 hour');
SELECT sqlstreams.create_group('restore.audit', 'archiver');
SELECT sqlstreams.grant_stream('restore.orders', 'restore_alice', 'produce');
SELECT sqlstreams.grant_stream('restore.orders', 'restore_bob', 'consume', 'billing');
SELECT sqlstreams.grant_stream('restore.audit', 'restore_carol', 'consume');
-- A role dropped with its grant left behind: the dump leaves the grant out.
SELECT sqlstreams.grant_stream('restore.audit', 'restore_dave', 'consume');
DROP ROLE restore_dave;

SELECT sqlstreams.produce('restore.orders', jsonb_build_object('n', n)) FROM generate_series(1, 20) n;
SELECT sqlstreams.produce('restore.audit', jsonb_build_object('n', n)) FROM generate_series(1, 5) n;

-- billing: 1-20 claimed; 6-10 dead letters (no retries), the rest acked. shipping: 1-10
-- claimed; 1 and 2 wait for a retry an hour away, 3-10 acked. archiver: everything acked.
CREATE TEMP TABLE delivered AS SELECT 'billing' AS grp, * FROM sqlstreams.claim('restore.orders', 'billing', 20);
SELECT sqlstreams.ack('restore.orders', 'billing', lease_token, message_id)
FROM delivered WHERE message_id NOT BETWEEN 6 AND 10;
SELECT sqlstreams.fail('restore.orders', 'billing', lease_token, message_id, 'boom ' || message_id)
FROM delivered WHERE message_id BETWEEN 6 AND 10;
INSERT INTO delivered SELECT 'shipping', * FROM sqlstreams.claim('restore.orders', 'shipping', 10);
SELECT sqlstreams.fail('restore.orders', 'shipping', lease_token, message_id, 'later')
FROM delivered WHERE grp = 'shipping' AND message_id <= 2;
SELECT sqlstreams.ack('restore.orders', 'shipping', lease_token, message_id)
FROM delivered WHERE grp = 'shipping' AND message_id > 2;
SELECT sqlstreams.ack('restore.audit', 'archiver', lease_token, message_id)
FROM sqlstreams.claim('restore.audit', 'archiver', 10);
SELECT count(*) FROM sqlstreams.maintain();
