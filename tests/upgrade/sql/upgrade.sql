-- Upgrade test, phase 2: the streams tests/upgrade/before.sql left under the released 0.1.0,
-- upgraded in place, then used: nothing lost, every exception row intact, every function working.
ALTER EXTENSION sqlstreams UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'sqlstreams';
SELECT id, name, schema_version FROM sqlstreams.streams ORDER BY id;

-- Claims every lane until nothing is left, acking each claim's rows; returns what ran, with the
-- claim it came from and its run_after.
CREATE FUNCTION drain(stream text, grp text)
RETURNS TABLE (claim integer, message_id bigint, message_key text, attempt integer, run_after bigint)
LANGUAGE plpgsql AS $$
DECLARE
    n integer := 0;
    token uuid;
    ids bigint[];
BEGIN
    LOOP
        n := n + 1;
        token := NULL;
        ids := '{}';
        FOR message_id, message_key, attempt, token, run_after IN
            SELECT c.message_id, c.message_key, c.attempt, c.lease_token, c.run_after FROM sqlstreams.claim(stream, grp) c
        LOOP
            claim := n;
            ids := ids || message_id;
            RETURN NEXT;
        END LOOP;
        EXIT WHEN token IS NULL;
        PERFORM sqlstreams.ack_batch(stream, grp, token, ids);
    END LOOP;
END
$$;

-- Every row of every stream table is as it was, except the quarantine fix-up: rows quarantined
-- under 0.1.0 that never ran since lose the failure 0.1.0 charged them.
SELECT 'before' AS side, t, row FROM (SELECT * FROM upgrade_snapshot EXCEPT SELECT * FROM upgrade_rows) gone
UNION ALL
SELECT 'after', t, row FROM (SELECT * FROM upgrade_rows EXCEPT SELECT * FROM upgrade_snapshot) came
ORDER BY t, row, side;
SELECT message_id, status, attempts, isolated FROM sqlstreams.exception_queue_3 ORDER BY message_id;

-- Ordered: the open range and the inflight retry answer with their 0.1.0 tokens.
SELECT sqlstreams.ack_batch('upgrade.ordered', 'g', token, ids) FROM upgrade_claims WHERE name = 'ordered-range';
SELECT sqlstreams.ack('upgrade.ordered', 'g', token, 6) FROM upgrade_claims WHERE name = 'ordered-inflight';
-- The retry of 1 comes due: it runs first, then 2 and 5 behind it; 7 (key b, another lane)
-- is free.
UPDATE sqlstreams.exception_queue_1 SET can_run_after = now() - interval '1 second' WHERE status IN ('ready', 'deferred');
SELECT * FROM drain('upgrade.ordered', 'g');
SELECT claimed, committed, head, lag, open_ranges, ready, inflight, deferred, dead FROM sqlstreams.group_status('upgrade.ordered', 'g');

-- Exclusive: key k was held under a 0.1.0 key lease by message 1, still in flight in a range
-- claimed before lanes. The key stays held: 3, due now, waits until 1 is acked.
SELECT message_key, lease_token = (SELECT token FROM upgrade_claims WHERE name = 'exclusive-held') AS held_by_1
FROM upgrade_key_leases;
UPDATE sqlstreams.exception_queue_2 SET can_run_after = now() - interval '1 second' WHERE status = 'deferred';
SELECT count(*) AS handed_out FROM sqlstreams.claim('upgrade.exclusive', 'g');
SELECT message_id, status FROM sqlstreams.exception_queue_2 ORDER BY message_id;
-- 1's ack wakes 3; 2 stays superseded and the poison message dead.
SELECT sqlstreams.ack('upgrade.exclusive', 'g', token, 1) FROM upgrade_claims WHERE name = 'exclusive-held';
CREATE TEMP TABLE d AS SELECT * FROM sqlstreams.claim('upgrade.exclusive', 'g');
SELECT message_id, message_key, attempt, run_after FROM d;
SELECT sqlstreams.ack('upgrade.exclusive', 'g', lease_token, message_id) FROM d;
DROP TABLE d;
SELECT message_id, message_key, attempts, last_error FROM sqlstreams.dead_messages('upgrade.exclusive', 'g');
SELECT count(*) AS open_leases FROM sqlstreams.open_leases('upgrade.exclusive', 'g');
SELECT claimed, committed, dead, superseded FROM sqlstreams.group_status('upgrade.exclusive', 'g');

-- Quarantine: each quarantined message is now delivered alone, at once.
CREATE TEMP TABLE d AS SELECT * FROM sqlstreams.claim('upgrade.quarantine', 'g');
SELECT message_id, attempt FROM d;
SELECT sqlstreams.ack('upgrade.quarantine', 'g', lease_token, message_id) FROM d;
DROP TABLE d;
CREATE TEMP TABLE d AS SELECT * FROM sqlstreams.claim('upgrade.quarantine', 'g');
SELECT message_id, attempt FROM d;
SELECT sqlstreams.ack('upgrade.quarantine', 'g', lease_token, message_id) FROM d;
DROP TABLE d;
SELECT claimed, committed, lag FROM sqlstreams.group_status('upgrade.quarantine', 'g');

-- Idempotency keys recorded under 0.1.0 still suppress repeats.
SELECT sqlstreams.produce('upgrade.idempotent', '{"n": 1}', idempotency_key => 'order-1') AS repeated;
CREATE TEMP TABLE d AS SELECT * FROM sqlstreams.claim('upgrade.idempotent', 'g');
SELECT message_id, payload FROM d;
SELECT sqlstreams.ack('upgrade.idempotent', 'g', lease_token, message_id) FROM d;
DROP TABLE d;

-- Headers and delayed delivery on an upgraded stream.
SELECT sqlstreams.produce('upgrade.idempotent', '{"n": 3}', headers => '{"h": "v"}') > 0 AS produced;
SELECT sqlstreams.produce('upgrade.idempotent', '{"n": 4}', deliver_after => '1 hour') > 0 AS produced;
CREATE TEMP TABLE d AS SELECT * FROM sqlstreams.claim_with_metadata('upgrade.idempotent', 'g');
SELECT payload, headers, produced_at IS NOT NULL AS has_produced_at FROM d;
SELECT sqlstreams.ack('upgrade.idempotent', 'g', lease_token, message_id) FROM d;
DROP TABLE d;

-- Ranges open across lanes are one range per lane now, under the same token; the lane of the
-- oldest pending message keeps the row.
SELECT r.first_id, r.last_id, r.lane, r.pending, r.pending_keys, c.name AS claim, r.lease_expires_at < now() AS expired
FROM sqlstreams.range_lease_5 r JOIN upgrade_claims c ON c.token = r.lease_token ORDER BY r.first_id;
SELECT bool_and(r.lane = sqlstreams.lane(k.key, k.id, 16)) AS every_message_in_its_ranges_lane
FROM sqlstreams.range_lease_5 r, unnest(r.pending, r.pending_keys) AS k(id, key);
-- The open one's messages answer with their 0.1.0 token; the expired one's are handed out
-- again, lane by lane, each once.
SELECT sqlstreams.ack_batch('upgrade.lanes', 'g', token, ids) FROM upgrade_claims WHERE name = 'lanes-open';
SELECT message_id, message_key, attempt FROM drain('upgrade.lanes', 'g') ORDER BY message_id;
SELECT claimed, committed, lag, open_ranges FROM sqlstreams.group_status('upgrade.lanes', 'g');

-- New messages on an upgraded stream, a new group, a new stream with its own lane count.
SELECT count(*) FROM sqlstreams.produce_batch('upgrade.ordered', ARRAY['{"n": 8}', '{"n": 9}']::jsonb[], ARRAY['a', 'd']);
SELECT sqlstreams.create_group('upgrade.ordered', 'late', start_at => 'beginning');
SELECT count(*) FROM drain('upgrade.ordered', 'late');
SELECT sqlstreams.create_stream('upgrade.new', partition_size => 1000, lanes => 4);
SELECT sqlstreams.create_group('upgrade.new', 'g', 'ordered');
SELECT count(*) FROM sqlstreams.produce_batch('upgrade.new', ARRAY['{}', '{}', '{}', '{}']::jsonb[], ARRAY['x', 'x', 'y', 'x']);
SELECT * FROM drain('upgrade.new', 'g');
SELECT name, schema_version, lanes FROM sqlstreams.streams WHERE name = 'upgrade.new';
SELECT stream, cursors_advanced >= 0 AS ran FROM sqlstreams.maintain() ORDER BY stream;
SELECT sqlstreams.drop_group('upgrade.ordered', 'late');
SELECT stream, name, claimed, committed, lag FROM sqlstreams.consumer_groups ORDER BY stream, name;
