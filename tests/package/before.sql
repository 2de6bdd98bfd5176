-- Debian package test, step 1 (scripts/rig test): a database made with the released 0.1.0,
-- built from its commit and installed by hand, before the package is installed over it.
\set ON_ERROR_STOP on
\set QUIET on
CREATE EXTENSION sqlstreams VERSION '0.1.0';
SELECT sqlstreams.create_stream('package.upgraded');
SELECT sqlstreams.create_group('package.upgraded', 'g', 'ordered');
SELECT sqlstreams.produce('package.upgraded', jsonb_build_object('n', n), 'k') FROM generate_series(1, 3) n;
-- The first message is delivered and acknowledged under 0.1.0.
SELECT sqlstreams.ack('package.upgraded', 'g', c.token, c.message_id)
FROM sqlstreams.claim('package.upgraded', 'g', 1) AS c(message_id, message_key, concurrency, attempt, payload, token, run_after);
