-- The same failure, resolved the two other ways the ordering guide names: a permanent failure (dead
-- releases the next message) and a requested delay (keeps the key waiting).
SELECT sqlstreams.drop_stream('ledger.adjustments');
SELECT sqlstreams.create_stream('ledger.adjustments') AS stream_id;
SELECT sqlstreams.create_group('ledger.adjustments', 'apply-balance', 'ordered') AS group_id;
SELECT count(*) FROM sqlstreams.produce_batch('ledger.adjustments',
    ARRAY['{"delta": -500}', '{"delta": 200}', '{"delta": 75}']::jsonb[],
    ARRAY['acct-42', 'acct-42', 'acct-42']);

-- One claim chains 1 -> 2 -> 3.
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt, run_after FROM delivery ORDER BY message_id;

-- Permanent failure: 1 is dead at once ('dead' tells the consumer its chain may go on).
SELECT sqlstreams.fail('ledger.adjustments', 'apply-balance', lease_token, message_id, 'unknown account', permanent => true)
FROM delivery WHERE message_id = 1;
SELECT message_id, status, attempts, last_error FROM sqlstreams.exception_queue_2 ORDER BY message_id;
-- A dead predecessor is visible for triage; it does not mean its operation happened.
SELECT message_id, message_key, attempts, last_error, payload
FROM sqlstreams.dead_messages('ledger.adjustments', 'apply-balance');

-- So 2 runs next, and asks to run again in an hour: 3 is recorded deferred behind it.
SELECT sqlstreams.delay('ledger.adjustments', 'apply-balance', lease_token, 2, '1 hour') FROM delivery WHERE message_id = 2;
SELECT message_id, status, attempts, delays, can_run_after > now() + interval '59 minutes' AS in_an_hour
FROM sqlstreams.exception_queue_2 ORDER BY message_id;
SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');  -- the key waits

-- When the delay is over, 2 runs; its success hands the key to 3 in the very next claim.
UPDATE sqlstreams.exception_queue_2 SET can_run_after = now() WHERE message_id = 2;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt, run_after FROM delivery ORDER BY message_id;
SELECT sqlstreams.ack('ledger.adjustments', 'apply-balance', lease_token, 2) FROM delivery;
DROP TABLE delivery;
CREATE TEMP TABLE delivery AS SELECT * FROM sqlstreams.claim('ledger.adjustments', 'apply-balance');
SELECT message_id, attempt, run_after FROM delivery ORDER BY message_id;
