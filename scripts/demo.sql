-- The apply-balance story from the ordering guide, in plain SQL: ordered delivery through a failure.
\pset footer off
\set QUIET on
\set ON_ERROR_STOP on
CREATE EXTENSION IF NOT EXISTS sqlstreams;

\echo
\echo '== A stream of balance adjustments, and a group that applies them in order per account'
SELECT sqlstreams.create_stream('ledger.adjustments') AS stream_id;
SELECT sqlstreams.create_group('ledger.adjustments', 'apply-balance',
                               concurrency_override => 'ordered', backoff_base => '1 second') AS group_id;

\echo '== Four deltas for acct-42, produced in one business transaction (the outbox pattern)'
BEGIN;
SELECT sqlstreams.produce('ledger.adjustments', jsonb_build_object('account', 'acct-42', 'delta', d), 'acct-42') AS message_id
FROM unnest(ARRAY[-500, 200, 75, -20]) AS d;
COMMIT;

\echo '== A consumer claims: message 1 may start now, 2-4 are chained behind it (run_after)'
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, message_key, concurrency, attempt, payload, run_after FROM delivery;

\echo '== The handler of message 1 fails (insufficient funds)'
SELECT sqlstreams.fail('ledger.adjustments', 'apply-balance', lease_token, message_id, 'insufficient funds') AS new_status
FROM delivery WHERE message_id = 1;

\echo '== The ordering guide''s inspect query: 1 waits for its retry, 2-4 are deferred and never ran'
SELECT
    message_id,
    message_key,
    status,
    attempts,
    can_run_after
FROM sqlstreams.exception_queue_1
WHERE consumer_group_id = 1 AND message_key = 'acct-42'
ORDER BY message_id;

\echo '== Nothing of acct-42 may run before the retry is due:'
SELECT count(*) AS claimable_now FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');

\echo '== ... a second later the retry of 1 runs first'
\o /dev/null
SELECT pg_sleep(1.2);
\o
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt, run_after FROM delivery;

\echo '== It succeeds; the chain 2 -> 3 -> 4 runs next, in order'
SELECT sqlstreams.ack('ledger.adjustments', 'apply-balance', lease_token, message_id) AS acked FROM delivery WHERE message_id = 1;
SELECT message_id, attempt, run_after FROM delivery WHERE message_id > 1;
SELECT sqlstreams.ack_batch('ledger.adjustments', 'apply-balance', (SELECT lease_token FROM delivery LIMIT 1),
                            ARRAY(SELECT message_id FROM delivery WHERE message_id > 1)) AS acked;

\echo '== The group is caught up'
SELECT name, claimed, committed, lag, ready, deferred, dead FROM sqlstreams.consumer_groups;
