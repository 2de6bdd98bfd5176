-- Refused calls: SQLSTATE-bearing messages that say what to do instead.
\set VERBOSITY default
SELECT sqlstreams.produce('no.such.stream', '{}');
SELECT * FROM sqlstreams.claim('account.state', 'no-such-group');
SELECT sqlstreams.produce('account.state', '{}', 'k', 'fifo');
SELECT sqlstreams.produce('account.state', '{}', NULL, 'ordered');
SELECT sqlstreams.create_group('account.state', 'g', start_at => 'tail');
SELECT * FROM sqlstreams.claim('account.state', 'cache', 0);
SELECT * FROM sqlstreams.claim('account.state', 'cache', 10, '0 seconds');
SELECT sqlstreams.create_stream('account.state', 5000);
SELECT sqlstreams.create_stream('account.state', lanes => 8);
SELECT sqlstreams.create_stream('tiny.partitions', 10);
SELECT sqlstreams.create_stream('huge.partitions', 9223372036854775807);
SELECT sqlstreams.create_stream('no.lanes', lanes => 0);
SELECT sqlstreams.produce_batch('account.state', array[['{}', '{}'], ['{}', '{}']]::jsonb[]);
SELECT sqlstreams.stream_head(-1);
SELECT sqlstreams.create_stream('');
-- Names are data: quotes and semicolons are just characters.
SELECT sqlstreams.create_stream('Robert''); DROP TABLE sqlstreams.stream; --') > 0 AS created;
SELECT name FROM sqlstreams.streams ORDER BY id;
-- The API is documented in the catalog.
-- (Each stream's trigger function, exception_count_<id>, belongs to the stream, not the API.)
SELECT p.proname, obj_description(p.oid, 'pg_proc') IS NOT NULL AS documented
FROM pg_proc p WHERE p.pronamespace = 'sqlstreams'::regnamespace AND p.proname !~ '^exception_count_[0-9]+$'
ORDER BY 1;
-- Every function runs with a pinned search_path: nothing a caller creates on their own path
-- is picked up by the extension's SQL.
-- (A function with a SQL-standard body is parsed when it is created: the caller's path cannot
-- reach it. claim and claim_with_metadata pin it themselves before their first statement,
-- src/search_path.rs; tests/privileges.rs sets a trap for both.)
SELECT p.proname, p.proconfig FROM pg_proc p
WHERE p.pronamespace = 'sqlstreams'::regnamespace AND p.prosqlbody IS NULL
  AND p.proname NOT IN ('claim', 'claim_with_metadata')
  AND NOT 'search_path=pg_catalog, pg_temp' = ANY(coalesce(p.proconfig, '{}'));
SELECT p.oid::regprocedure, p.proconfig FROM pg_proc p
WHERE p.pronamespace = 'sqlstreams'::regnamespace AND p.proname IN ('claim', 'claim_with_metadata')
ORDER BY 1::text;
