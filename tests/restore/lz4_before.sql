-- pg_upgrade test, on PostgreSQL 15 (built with lz4): a claim of 150 keyed messages leaves a
-- range open whose keys a claim stored with lz4 (docs/operations.md, "A claim writes its
-- ranges ... compressed with lz4"): one lane, so one range of them all, past the 2 kB at
-- which Postgres compresses a row. Its token is kept for the upgraded cluster to ack with.
\set ON_ERROR_STOP on
\set QUIET on
CREATE EXTENSION sqlstreams;
SELECT sqlstreams.create_stream('upgrade.keyed', lanes => 1) AS stream_id \gset
SELECT sqlstreams.create_group('upgrade.keyed', 'g', 'ordered');
SELECT count(*) FROM sqlstreams.produce_batch('upgrade.keyed', array_fill('{}'::jsonb, ARRAY[150]),
                                              ARRAY(SELECT 'account-' || i FROM generate_series(1, 150) i));
CREATE TABLE open_claim AS
SELECT lease_token AS token, array_agg(message_id ORDER BY message_id) AS ids
FROM sqlstreams.claim('upgrade.keyed', 'g', 150, '1 hour') GROUP BY lease_token;
SELECT count(*) = 1 AND sum(cardinality(ids)) = 150 AS ok FROM open_claim \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the claim did not hand out the 150 messages under one token'; END $$;
\endif
SELECT count(*) = 1 AS ok FROM sqlstreams.range_lease_:stream_id WHERE pg_column_compression(pending_keys) = 'lz4' \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the open range''s keys are not stored with lz4'; END $$;
\endif
