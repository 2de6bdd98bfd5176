-- pg_upgrade test, on the upgraded cluster: the open range of lz4_before.sql, which
-- docs/operations.md's recipe stored again with pglz before the upgrade, is read by the ack of
-- its claim, and the group goes on.
\set ON_ERROR_STOP on
\set QUIET on
SELECT cardinality(sqlstreams.ack_batch('upgrade.keyed', 'g', token, ids)) = 150 AS ok FROM open_claim \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the ack of the open claim did not record its 150 messages'; END $$;
\endif
SELECT sqlstreams.produce('upgrade.keyed', '{}', 'account-1') AS next \gset
SELECT array_agg(message_id) = ARRAY[:next]::bigint[] AS ok FROM sqlstreams.claim('upgrade.keyed', 'g') \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the group did not go on after the upgrade'; END $$;
\endif
