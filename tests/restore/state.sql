-- Restore test: what a restore must keep, as text to compare between the dumped database and
-- each restored one (names, settings, grants by role name, cursors, counts, dead letters).
\set ON_ERROR_STOP on
\pset format unaligned
\pset footer off
SELECT name, partition_size, lanes, idempotency_ttl, dead_retention FROM sqlstreams.streams ORDER BY name;
SELECT stream, name, concurrency_override, max_retries, paused FROM sqlstreams.consumer_groups ORDER BY stream, name;
SELECT s.name, g.grantee::text, g.privilege, g.group_name
FROM sqlstreams.stream_grant g JOIN sqlstreams.stream s ON s.id = g.stream_id
WHERE g.grantee IN (SELECT oid FROM pg_catalog.pg_roles) ORDER BY 1, 2, 3, 4;
-- Not held_back_bytes, the log's size on disk, which a restore writes without dead space.
SELECT c.stream, c.name, to_jsonb(st) - 'held_back_bytes'
FROM sqlstreams.consumer_groups c, LATERAL sqlstreams.group_status(c.stream, c.name) st ORDER BY 1, 2;
SELECT c.stream, c.name, d.message_id, d.last_error
FROM sqlstreams.consumer_groups c, LATERAL sqlstreams.dead_messages(c.stream, c.name) d ORDER BY 1, 2, 3;
