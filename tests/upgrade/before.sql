-- Upgrade test, phase 1: run against the released 0.1.0 (scripts/rig test builds it from git
-- history). Leaves streams with messages in every state; tests/upgrade/sql/upgrade.sql then
-- runs ALTER EXTENSION sqlstreams UPDATE and goes on using them.
\set ON_ERROR_STOP on
\set QUIET on
CREATE EXTENSION sqlstreams VERSION '0.1.0';
-- Every table published, as change data capture or a migration has it: the upgrade, and all
-- that phase 2 does after it, run under it (Postgres refuses an update or delete of a published
-- table without a replica identity, whatever wal_level is; its warning about that is not shown).
SET client_min_messages = error;
CREATE PUBLICATION upgrade_everything FOR ALL TABLES;
RESET client_min_messages;

-- What phase 2 needs to answer 0.1.0 deliveries: their tokens and ids.
CREATE TABLE upgrade_claims (name text PRIMARY KEY, token uuid NOT NULL, ids bigint[] NOT NULL);
CREATE FUNCTION upgrade_keep(name text, stream text, grp text, batch int) RETURNS void LANGUAGE sql AS $$
    INSERT INTO upgrade_claims
    SELECT name, min(lease_token::text)::uuid, array_agg(message_id ORDER BY message_id)
    FROM sqlstreams.claim(stream, grp, batch, '1 hour');
$$;

-- Stream 1: an ordered group with a retry waiting (ready), messages deferred behind it and
-- behind its chain, an open range, an inflight retry, and messages not claimed yet.
SELECT sqlstreams.create_stream('upgrade.ordered');
SELECT sqlstreams.create_group('upgrade.ordered', 'g', 'ordered', backoff_base => '1 hour', backoff_cap => '1 hour');
SELECT sqlstreams.produce('upgrade.ordered', jsonb_build_object('n', n), k)
FROM unnest(ARRAY[1, 2, 3, 4, 5, 6], ARRAY['a', 'a', 'b', 'b', 'a', 'c']) AS u(n, k);
SELECT upgrade_keep('ordered-first', 'upgrade.ordered', 'g', 2);                    -- 1, 2 (chain of a)
SELECT sqlstreams.fail('upgrade.ordered', 'g', token, 1, 'boom') FROM upgrade_claims WHERE name = 'ordered-first';
SELECT upgrade_keep('ordered-range', 'upgrade.ordered', 'g', 3);                    -- 3, 4 run; 5 deferred
SELECT sqlstreams.fail('upgrade.ordered', 'g', token, 6, 'boom', retry_after => '0 seconds')
FROM sqlstreams.claim('upgrade.ordered', 'g', 1, '1 hour') AS c(message_id, message_key, concurrency, attempt, payload, token, run_after);
SELECT upgrade_keep('ordered-inflight', 'upgrade.ordered', 'g', 10);                -- the retry of 6
SELECT sqlstreams.produce('upgrade.ordered', jsonb_build_object('n', 7), 'b');        -- not claimed yet

-- Stream 2: exclusive with compaction: a held key lease, a superseded message, a dead one.
SELECT sqlstreams.create_stream('upgrade.exclusive');
SELECT sqlstreams.create_group('upgrade.exclusive', 'g', 'exclusive');
SELECT sqlstreams.produce('upgrade.exclusive', jsonb_build_object('n', 1), 'k', compaction => true);
SELECT upgrade_keep('exclusive-held', 'upgrade.exclusive', 'g', 10);               -- 1 holds key k
SELECT sqlstreams.produce('upgrade.exclusive', jsonb_build_object('n', n), 'k', compaction => true)
FROM generate_series(2, 3) n;
SELECT count(*) FROM sqlstreams.claim('upgrade.exclusive', 'g');                  -- 2 superseded, 3 deferred
SELECT sqlstreams.produce('upgrade.exclusive', jsonb_build_object('n', 4), 'poison');
SELECT sqlstreams.fail('upgrade.exclusive', 'g', c.token, c.message_id, 'bad payload', permanent => true)
FROM sqlstreams.claim('upgrade.exclusive', 'g') AS c(message_id, message_key, concurrency, attempt, payload, token, run_after);

-- Stream 3: a range that kept expiring, quarantined the 0.1.0 way (a failure charged at once).
SELECT sqlstreams.create_stream('upgrade.quarantine');
SELECT sqlstreams.create_group('upgrade.quarantine', 'g');
SELECT count(*) FROM sqlstreams.produce_batch('upgrade.quarantine', ARRAY['{"n": 1}', '{"n": 2}']::jsonb[]);
DO $$
BEGIN
    FOR i IN 1..3 LOOP
        PERFORM count(*) FROM sqlstreams.claim('upgrade.quarantine', 'g');
        UPDATE sqlstreams.range_lease_3 SET lease_expires_at = now() - interval '1 second';
    END LOOP;
END
$$;
SELECT count(*) FROM sqlstreams.claim('upgrade.quarantine', 'g');                  -- quarantines 1, 2

-- Stream 4: idempotency keys, one message consumed, one waiting.
SELECT sqlstreams.create_stream('upgrade.idempotent');
SELECT sqlstreams.create_group('upgrade.idempotent', 'g');
SELECT sqlstreams.produce('upgrade.idempotent', '{"n": 1}', idempotency_key => 'order-1');
SELECT sqlstreams.ack('upgrade.idempotent', 'g', c.token, c.message_id)
FROM sqlstreams.claim('upgrade.idempotent', 'g') AS c(message_id, message_key, concurrency, attempt, payload, token, run_after);
SELECT sqlstreams.produce('upgrade.idempotent', '{"n": 2}', idempotency_key => 'order-2');

-- Stream 5: ranges open across keys of different lanes (0.1.0 had no lanes): one whose lease
-- holds, one that expired.
SELECT sqlstreams.create_stream('upgrade.lanes');
SELECT sqlstreams.create_group('upgrade.lanes', 'g');
SELECT sqlstreams.produce('upgrade.lanes', jsonb_build_object('n', n), k)
FROM unnest(ARRAY[1, 2, 3, 4, 5, 6], ARRAY['x', 'y', NULL, 'z', 'w', NULL]) AS u(n, k);
SELECT upgrade_keep('lanes-open', 'upgrade.lanes', 'g', 10);                        -- 1-6, leased
SELECT sqlstreams.produce('upgrade.lanes', jsonb_build_object('n', n), k)
FROM unnest(ARRAY[7, 8, 9], ARRAY['x', 'y', NULL]) AS u(n, k);
SELECT upgrade_keep('lanes-expired', 'upgrade.lanes', 'g', 10);                     -- 7-9
UPDATE sqlstreams.range_lease_5 SET lease_expires_at = now() - interval '1 second'
WHERE lease_token = (SELECT token FROM upgrade_claims WHERE name = 'lanes-expired');

-- Every row of every stream table, as text: phase 2 compares it after the upgrade.
CREATE VIEW upgrade_rows AS
SELECT 'exception_queue' AS t, format('%s/%s %s %s %s %s %s %s %s %s', e.stream, e.consumer_group_id, e.message_id,
       e.message_key, e.concurrency, e.status, e.attempts, e.delays, e.lease_token, e.last_error) AS row
FROM (SELECT 1 AS stream, consumer_group_id, message_id, message_key, concurrency, status, attempts, delays,
             lease_token, last_error FROM sqlstreams.exception_queue_1
      UNION ALL SELECT 2, consumer_group_id, message_id, message_key, concurrency, status, attempts, delays,
             lease_token, last_error FROM sqlstreams.exception_queue_2
      UNION ALL SELECT 3, consumer_group_id, message_id, message_key, concurrency, status, attempts, delays,
             lease_token, last_error FROM sqlstreams.exception_queue_3
      UNION ALL SELECT 4, consumer_group_id, message_id, message_key, concurrency, status, attempts, delays,
             lease_token, last_error FROM sqlstreams.exception_queue_4) e
UNION ALL SELECT 'message_log', format('%s %s %s %s %s', m.tableoid::regclass, m.id, m.message_key, m.compaction, m.payload)
FROM (SELECT tableoid, id, message_key, compaction, payload FROM sqlstreams.message_log_1
      UNION ALL SELECT tableoid, id, message_key, compaction, payload FROM sqlstreams.message_log_2
      UNION ALL SELECT tableoid, id, message_key, compaction, payload FROM sqlstreams.message_log_3
      UNION ALL SELECT tableoid, id, message_key, compaction, payload FROM sqlstreams.message_log_4) m
UNION ALL SELECT 'range_lease', format('%s/%s %s %s %s %s %s', r.stream, r.consumer_group_id, r.first_id, r.last_id,
       r.lease_token, r.pending, r.pending_keys)
FROM (SELECT 1 AS stream, consumer_group_id, first_id, last_id, lease_token, pending, pending_keys FROM sqlstreams.range_lease_1
      UNION ALL SELECT 2, consumer_group_id, first_id, last_id, lease_token, pending, pending_keys FROM sqlstreams.range_lease_2
      UNION ALL SELECT 3, consumer_group_id, first_id, last_id, lease_token, pending, pending_keys FROM sqlstreams.range_lease_3
      UNION ALL SELECT 4, consumer_group_id, first_id, last_id, lease_token, pending, pending_keys FROM sqlstreams.range_lease_4) r
UNION ALL SELECT 'cursor', format('%s/%s %s %s', c.stream, c.consumer_group_id, c.claimed, c.committed)
FROM (SELECT 1 AS stream, consumer_group_id, claimed, committed FROM sqlstreams.cursor_1
      UNION ALL SELECT 2, consumer_group_id, claimed, committed FROM sqlstreams.cursor_2
      UNION ALL SELECT 3, consumer_group_id, claimed, committed FROM sqlstreams.cursor_3
      UNION ALL SELECT 4, consumer_group_id, claimed, committed FROM sqlstreams.cursor_4) c
UNION ALL SELECT 'compaction_head', format('%s %s', message_key, message_id) FROM sqlstreams.compaction_head_2
UNION ALL SELECT 'idempotency_key', format('%s %s', idempotency_key, message_id) FROM sqlstreams.idempotency_key_4;

CREATE TABLE upgrade_snapshot AS SELECT * FROM upgrade_rows;
-- 0.2.0 holds keys by lanes and drops the key leases; phase 2 checks the held key stays held.
CREATE TABLE upgrade_key_leases AS SELECT consumer_group_id, message_key, lease_token FROM sqlstreams.message_key_lease_2;
