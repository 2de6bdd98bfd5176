-- What inspection shows; the standby must show what the primary shows.
SELECT name, head FROM sqlstreams.streams ORDER BY name;
SELECT stream, name, claimed, committed, head, lag, open_ranges, ready, inflight, deferred, dead, superseded
FROM sqlstreams.consumer_groups ORDER BY stream, name;
SELECT message_id, message_key, attempts, last_error, payload FROM sqlstreams.dead_messages('orders', 'billing');
SELECT message_id, message_key, payload FROM sqlstreams.peek('orders', 8);
SELECT sqlstreams.stream_head(id) FROM sqlstreams.stream ORDER BY id;
