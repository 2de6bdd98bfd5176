-- Views and documentation of the public API. Runs after every function exists.

CREATE VIEW sqlstreams.streams AS
SELECT s.id, s.name, s.partition_size, s.idempotency_ttl, s.created_at,
       sqlstreams.stream_head(s.id) AS head
FROM sqlstreams.stream s;

CREATE VIEW sqlstreams.consumer_groups AS
SELECT g.id, g.stream_id, s.name AS stream, g.name, g.concurrency_override, g.max_retries,
       g.backoff_base, g.backoff_cap, g.backoff_exponent, g.max_delays, g.max_reclaims, g.created_at,
       p.claimed, p.committed, p.head, p.lag, p.open_ranges, p.ready, p.inflight, p.deferred, p.dead,
       p.superseded
FROM sqlstreams.consumer_group g
JOIN sqlstreams.stream s ON s.id = g.stream_id
CROSS JOIN LATERAL sqlstreams.group_status(s.name, g.name) p;

COMMENT ON SCHEMA sqlstreams IS
    'sqlstreams: durable message streams with consumer groups and per-key parallel/exclusive/ordered delivery';
COMMENT ON TABLE sqlstreams.stream IS 'Catalog of streams; read it through the sqlstreams.streams view.';
COMMENT ON TABLE sqlstreams.consumer_group IS 'Catalog of consumer groups and their settings; see sqlstreams.consumer_groups.';
COMMENT ON VIEW sqlstreams.streams IS 'Every stream with its id (its tables are named by it) and head (highest message id handed out).';
COMMENT ON VIEW sqlstreams.consumer_groups IS
    'Every consumer group with its settings, cursor (claimed, committed), lag and exception-queue counts.';

COMMENT ON FUNCTION sqlstreams.create_stream(text, bigint, interval) IS
    'Creates a stream and its table family and returns its id; an existing name returns its id. '
    'Takes: the stream catalog row, DDL locks on the new tables.';
COMMENT ON FUNCTION sqlstreams.drop_stream(text) IS
    'Drops a stream with its groups, messages and exception queue; false when no such stream exists.';
COMMENT ON FUNCTION sqlstreams.create_group(text, text, text, integer, text, interval, interval, double precision, integer, integer) IS
    'Creates a consumer group (or updates the settings of an existing one) and returns its id. '
    'concurrency_override: NULL, parallel, exclusive or ordered; start_at: beginning or head.';
COMMENT ON FUNCTION sqlstreams.drop_group(text, text) IS
    'Drops a consumer group with its cursor, leases and exception-queue rows; false when it does not exist.';
COMMENT ON FUNCTION sqlstreams.produce(text, jsonb, text, text, boolean, text) IS
    'Appends a message in the caller''s transaction and returns its id (NULL for a repeated idempotency_key). '
    'Takes: a transaction id before the message id; the key''s compaction head row until commit.';
COMMENT ON FUNCTION sqlstreams.produce_batch(text, jsonb[], text[], text, boolean) IS
    'Appends many messages in one call (the fast path); returns their ids in payload order.';
COMMENT ON FUNCTION sqlstreams.claim(text, text, integer, interval, uuid, bigint[]) IS
    'Returns the work a consumer may run now under one lease: a claimed range and due exception rows, '
    'in id order; run_after chains same-key rows. Takes: the group''s cursor row until commit. '
    'Call it in its own READ COMMITTED transaction; an idle call writes nothing. '
    'ack_lease_token/ack_message_ids first record successes of an earlier claim (one round trip, one commit).';
COMMENT ON FUNCTION sqlstreams.ack(text, text, uuid, bigint) IS
    'Records a handler success; false when the lease behind lease_token was lost (nothing changed).';
COMMENT ON FUNCTION sqlstreams.ack_batch(text, text, uuid, bigint[]) IS
    'Records success for many messages of one claim; returns the ids recorded.';
COMMENT ON FUNCTION sqlstreams.fail(text, text, uuid, bigint, text, boolean, interval) IS
    'Records a handler failure; returns ready (retry scheduled) or dead, NULL when the lease was lost. '
    'The rest of the message''s same-key chain is recorded deferred.';
COMMENT ON FUNCTION sqlstreams.delay(text, text, uuid, bigint, interval) IS
    'Asks for a message to run again after delay without counting a failure; false when the lease was lost.';
COMMENT ON FUNCTION sqlstreams.group_status(text, text) IS
    'One group''s claimed and committed cursor, head, lag, open ranges and exception-queue counts.';
COMMENT ON FUNCTION sqlstreams.blocked_keys(text, text) IS
    'Keys waiting in the exception queue: the oldest unresolved message of each, its status and how many wait behind it.';
COMMENT ON FUNCTION sqlstreams.dead_messages(text, text) IS 'Dead-lettered messages of a group with their payloads, for triage.';
COMMENT ON FUNCTION sqlstreams.open_leases(text, text) IS 'Range, exception-row and exclusive-key leases a group holds now.';
COMMENT ON FUNCTION sqlstreams.stream_head(bigint) IS 'The highest message id handed out on a stream, by stream id.';
COMMENT ON FUNCTION sqlstreams.maintain() IS
    'Housekeeping for every stream: partitions ahead of the head, expired idempotency keys, idle groups'' committed cursors.';
COMMENT ON FUNCTION sqlstreams.extend_lease(text, text, uuid, interval) IS
    'Extends every lease held under a claim''s token (a heartbeat while handlers run); false when nothing is held any more.';
COMMENT ON FUNCTION sqlstreams.release(text, text, uuid, bigint[]) IS
    'Gives claimed deliveries back unstarted, due at once and without counting an attempt; returns the ids released.';
