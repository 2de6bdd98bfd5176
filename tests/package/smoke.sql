-- Debian package test, step 3: a new database with the extension made by the package alone
-- (the install script pgrx packaged: the hand-written one, with its tables), then a produce, a
-- claim and an ack, each committed on its own as a producer's and a consumer's would be.
-- A check that fails raises; psql stops there (ON_ERROR_STOP), as it does when \gset gets no row.
\set ON_ERROR_STOP on
\set QUIET on
CREATE EXTENSION sqlstreams;
SELECT count(*) > 0 AS ok FROM pg_catalog.pg_tables WHERE schemaname = 'sqlstreams' \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'CREATE EXTENSION sqlstreams made no tables'; END $$;
\endif
SELECT sqlstreams.create_stream('package.smoke');
SELECT sqlstreams.create_group('package.smoke', 'g', 'ordered');
SELECT sqlstreams.produce('package.smoke', '{"hello": "package"}', 'k') AS produced \gset
SELECT message_id AS claimed, lease_token, payload = '{"hello": "package"}' AS same_payload
FROM sqlstreams.claim('package.smoke', 'g') \gset
SELECT :claimed = :produced AND :'same_payload'::boolean AS ok \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the claim did not deliver the message produced'; END $$;
\endif
SELECT sqlstreams.ack('package.smoke', 'g', :'lease_token', :claimed) AS ok \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the ack was not recorded'; END $$;
\endif
SELECT committed >= :produced AS ok FROM sqlstreams.group_status('package.smoke', 'g') \gset
\if :ok
\else
    DO $$ BEGIN RAISE 'the group did not move past the acknowledged message'; END $$;
\endif
