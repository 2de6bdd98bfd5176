-- The ordering guide's "Ordered delivery through a failure", with the guide's own ids: stream
-- ledger.adjustments is stream 1, group apply-balance is group 7, and the four deltas of
-- acct-42 are messages 101-104. "The handler ran" means "claim handed the message out".
-- Time passing (a retry coming due) is simulated by moving can_run_after; nothing sleeps.
CREATE EXTENSION sqlstreams;
SELECT sqlstreams.create_stream('ledger.adjustments') AS stream_id;
SELECT sqlstreams.create_group('ledger.adjustments', 'audit-' || n) AS other_groups
FROM generate_series(1, 6) AS n;
SELECT sqlstreams.create_group('ledger.adjustments', 'apply-balance',
                               concurrency_override => 'ordered') AS group_id;

-- Messages 1-100: earlier traffic on other accounts, applied already.
SELECT count(*) AS produced FROM sqlstreams.produce_batch('ledger.adjustments',
    ARRAY(SELECT jsonb_build_object('account', 'acct-' || n, 'delta', n) FROM generate_series(1, 100) n),
    ARRAY(SELECT 'acct-' || n FROM generate_series(1, 100) n));
DO $$
DECLARE
    token uuid;
    ids bigint[];
BEGIN
    LOOP  -- a lane another claim holds waits: claim until every lane is drained
        SELECT min(lease_token::text)::uuid, array_agg(message_id) INTO token, ids
        FROM sqlstreams.claim('ledger.adjustments', 'apply-balance', 100);
        EXIT WHEN token IS NULL;
        PERFORM sqlstreams.ack_batch('ledger.adjustments', 'apply-balance', token, ids);
    END LOOP;
END
$$;
SELECT committed AS applied FROM sqlstreams.group_status('ledger.adjustments', 'apply-balance');

-- The four deltas of acct-42.
SELECT sqlstreams.produce('ledger.adjustments', '{"account": "acct-42", "delta": -500}', 'acct-42') AS message_id;
SELECT sqlstreams.produce('ledger.adjustments', '{"account": "acct-42", "delta": 200}', 'acct-42') AS message_id;
SELECT sqlstreams.produce('ledger.adjustments', '{"account": "acct-42", "delta": 75}', 'acct-42') AS message_id;
SELECT sqlstreams.produce('ledger.adjustments', '{"account": "acct-42", "delta": -20}', 'acct-42') AS message_id;

-- One claim: 101 may start now, 102-104 are chained behind it (run_after).
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, message_key, concurrency, attempt, payload, run_after FROM delivery ORDER BY message_id;

-- 101's handler errors. The server records the rest of its chain deferred; their handlers
-- never started, so an outcome for them is refused.
SELECT sqlstreams.fail('ledger.adjustments', 'apply-balance', lease_token, 101, 'insufficient funds')
FROM delivery WHERE message_id = 101;
SELECT sqlstreams.ack('ledger.adjustments', 'apply-balance', lease_token, 102) AS ack_102_refused
FROM delivery WHERE message_id = 102;

-- The ordering guide's inspect query (can_run_after shown as "in the future?", since it is a timestamp).
SELECT
    message_id,
    message_key,
    status,
    attempts,
    can_run_after > now() AS waiting_for_retry
FROM sqlstreams.exception_queue_1
WHERE consumer_group_id = 7 AND message_key = 'acct-42'
ORDER BY message_id;
SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');  -- nothing may run yet
SELECT message_key, oldest_message_id, status, attempts, waiting_behind
FROM sqlstreams.blocked_keys('ledger.adjustments', 'apply-balance');

-- 101's retry comes due: it runs first, alone.
UPDATE sqlstreams.exception_queue_1 SET can_run_after = now() WHERE consumer_group_id = 7 AND message_id = 101;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt, run_after FROM delivery;

-- Its success deletes its row and releases 102, then 103, then 104, in the very next claim.
SELECT sqlstreams.ack('ledger.adjustments', 'apply-balance', lease_token, 101) FROM delivery;
SELECT message_id, status, attempts FROM sqlstreams.exception_queue_1
WHERE consumer_group_id = 7 AND message_key = 'acct-42' ORDER BY message_id;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt, run_after FROM delivery ORDER BY message_id;
SELECT cardinality(sqlstreams.ack_batch('ledger.adjustments', 'apply-balance',
                   (SELECT lease_token FROM delivery LIMIT 1),
                   ARRAY(SELECT message_id FROM delivery))) AS applied;
SELECT count(*) AS rows_left FROM sqlstreams.exception_queue_1 WHERE consumer_group_id = 7;
SELECT claimed, committed, lag, ready, deferred, dead
FROM sqlstreams.consumer_groups WHERE id = 7;
