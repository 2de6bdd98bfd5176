-- pg_upgrade test: how many ranges of lz4_before.sql's stream are stored with lz4.
SELECT id AS stream_id FROM sqlstreams.stream WHERE name = 'upgrade.keyed' \gset
SELECT count(*) FROM sqlstreams.range_lease_:stream_id WHERE pg_column_compression(pending_keys) = 'lz4';
