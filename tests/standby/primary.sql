-- The primary of the standby test (scripts/rig, run_standby_test): streams with groups in
-- several states, a dead letter, a checkpoint, and then more messages, so the sequence's last
-- WAL record (what a standby reads of it) runs 32 ids ahead of what was handed out.
CREATE EXTENSION sqlstreams;
SELECT sqlstreams.create_stream('orders', partition_size => 1000);
SELECT sqlstreams.create_group('orders', 'billing', 'ordered', max_retries => 0);
SELECT sqlstreams.create_group('orders', 'audit');
SELECT sqlstreams.produce_batch('orders', array_agg('{"n": 1}'::jsonb), array_agg('k' || i % 3))
FROM generate_series(1, 10) i;
-- billing acks two and fails one for good (max_retries 0: a dead letter)
SELECT sqlstreams.ack_batch('orders', 'billing', lease_token, array_agg(message_id))
FROM sqlstreams.claim('orders', 'billing', 2) GROUP BY lease_token;
SELECT sqlstreams.fail('orders', 'billing', lease_token, message_id, 'boom', true)
FROM sqlstreams.claim('orders', 'billing', 1);
CHECKPOINT;
SELECT sqlstreams.produce('orders', '{"after": "checkpoint"}', 'k1');
SELECT sqlstreams.create_stream('empty');
