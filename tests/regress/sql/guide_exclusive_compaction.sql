-- The ordering guide's other two examples: the exclusive 101/102 reorder and the compaction 102/103
-- supersession; and the refusal of ordered + compaction.
SELECT sqlstreams.drop_stream('ledger.adjustments');
-- Claims and acks until the group has nothing left (a lane another claim holds waits);
-- returns the group's committed cursor.
CREATE FUNCTION pg_temp.drain(stream text, grp text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    token uuid;
    ids bigint[];
BEGIN
    LOOP
        SELECT min(lease_token::text)::uuid, array_agg(message_id) INTO token, ids
        FROM sqlstreams.claim(stream, grp, 100);
        EXIT WHEN token IS NULL;
        PERFORM sqlstreams.ack_batch(stream, grp, token, ids);
    END LOOP;
    RETURN (SELECT committed FROM sqlstreams.group_status(stream, grp));
END
$$;
SELECT sqlstreams.create_stream('ledger.adjustments') AS stream_id;
SELECT sqlstreams.create_group('ledger.adjustments', 'apply-balance', 'exclusive') AS group_id;
SELECT count(*) FROM sqlstreams.produce_batch('ledger.adjustments',
    ARRAY(SELECT '{}'::jsonb FROM generate_series(1, 100)));
SELECT pg_temp.drain('ledger.adjustments', 'apply-balance') AS applied;

-- Exclusive: 101 subtracts 500 from acct-42 and fails; 102 adds 200.
SELECT sqlstreams.produce('ledger.adjustments', '{"account": "acct-42", "delta": -500}', 'acct-42') AS message_id;
SELECT sqlstreams.produce('ledger.adjustments', '{"account": "acct-42", "delta": 200}', 'acct-42') AS message_id;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, concurrency, run_after FROM delivery ORDER BY message_id;
-- acct-42's lane is held by this claim: no other consumer gets the key while 101 runs.
SELECT kind, lane = sqlstreams.lane('acct-42', 101, 16) AS acct_42s_lane
FROM sqlstreams.open_leases('ledger.adjustments', 'apply-balance') ORDER BY kind;
SELECT sqlstreams.fail('ledger.adjustments', 'apply-balance', lease_token, 101, 'insufficient funds') FROM delivery WHERE message_id = 101;
-- The failure released the key before 101's retry is due (nothing of the claim is left in
-- flight, so the lane is free), so 102 runs first.
SELECT kind, lane FROM sqlstreams.open_leases('ledger.adjustments', 'apply-balance') ORDER BY kind;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt, run_after FROM delivery;
SELECT sqlstreams.ack('ledger.adjustments', 'apply-balance', lease_token, 102) FROM delivery;
-- Then the retry of 101.
UPDATE sqlstreams.exception_queue_3 SET can_run_after = now() WHERE message_id = 101;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt FROM delivery;
SELECT sqlstreams.ack('ledger.adjustments', 'apply-balance', lease_token, 101) FROM delivery;

-- Compaction: updates 102 and 103 arrive while 101 runs; 102 is superseded by 103.
SELECT sqlstreams.create_stream('account.state') AS stream_id;
SELECT sqlstreams.create_group('account.state', 'cache', 'exclusive') AS group_id;
SELECT count(*) FROM sqlstreams.produce_batch('account.state', ARRAY(SELECT '{}'::jsonb FROM generate_series(1, 100)));
SELECT pg_temp.drain('account.state', 'cache') AS applied;
SELECT sqlstreams.produce('account.state', '{"balance": 1000}', 'acct-42', compaction => true) AS message_id;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('account.state', 'cache');
SELECT message_id FROM delivery;  -- 101 runs
SELECT sqlstreams.produce('account.state', '{"balance": 500}', 'acct-42', compaction => true) AS message_id;
SELECT sqlstreams.produce('account.state', '{"balance": 700}', 'acct-42', compaction => true) AS message_id;
-- 102 and 103 wait for the key: its lane is held by 101's claim, so nothing of it is handed out.
SELECT * FROM sqlstreams.claim('account.state', 'cache');
SELECT message_id, status FROM sqlstreams.exception_queue_4 ORDER BY message_id;
SELECT sqlstreams.ack('account.state', 'cache', lease_token, 101) FROM delivery;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('account.state', 'cache');
SELECT message_id, payload FROM delivery;  -- only the latest state runs: 102 is superseded
SELECT message_id, status FROM sqlstreams.exception_queue_4 ORDER BY message_id;

-- Ordered delivery refuses compaction, and writes nothing.
SELECT sqlstreams.produce('account.state', '{"balance": 1}', 'acct-42', 'ordered', true);
SELECT head FROM sqlstreams.streams WHERE name = 'account.state';
