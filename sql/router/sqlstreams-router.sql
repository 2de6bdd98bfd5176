-- sqlstreams-router.sql: a router database that spreads streams over several PostgreSQL
-- servers running sqlstreams ("shards"), with PL/Proxy (docs/scale-out.md).
--
-- Not an extension script: run it once in the router database, as a superuser, with
--   psql -v ON_ERROR_STOP=1 -f sql/router/sqlstreams-router.sql
-- then name the shards, in order, once each:
--   SELECT sqlstreams_router.add_shard('host=db1 port=5432 dbname=app');
--
-- Every stream lives on one shard, chosen when it is created through the router and kept in
-- sqlstreams_router.placement; every call of the API names its stream and runs on that shard,
-- under the same name and signature as there (schema sqlstreams), in a transaction of its own
-- on that shard. The shard checks the caller's rights: PL/Proxy connects as the calling role.

CREATE EXTENSION IF NOT EXISTS plproxy;

CREATE SCHEMA sqlstreams_router;
CREATE SCHEMA sqlstreams;

-- The shards, numbered from 0 in the order they were added.
CREATE TABLE sqlstreams_router.shard (
    shard    integer PRIMARY KEY CHECK (shard >= 0),
    conninfo text NOT NULL
);

-- Where each stream lives. Kept, not computed: adding a shard moves no stream, and a stream is
-- moved by copying it and changing its row (docs/scale-out.md, "Moving a stream").
CREATE TABLE sqlstreams_router.placement (
    stream text PRIMARY KEY,
    shard  integer NOT NULL REFERENCES sqlstreams_router.shard
);

-- The PL/Proxy cluster `sqlstreams_shards`, brought in line with the shard table. PL/Proxy needs
-- a power of two of partitions: partition i is shard i, and those past the last shard repeat
-- shard 0 (shard_of never names them; PL/Proxy opens one connection for both). The server is
-- altered, never dropped: user mappings and grants an operator added stay.
CREATE FUNCTION sqlstreams_router.configure() RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    shards     integer := (SELECT count(*) FROM sqlstreams_router.shard);
    partitions integer := 1;
    known      text[];
    options    text[] := '{}';
BEGIN
    IF shards = 0 THEN
        RAISE EXCEPTION 'sqlstreams router: no shard'
            USING ERRCODE = '55000', HINT = 'Add one with sqlstreams_router.add_shard(conninfo).';
    END IF;
    IF (SELECT max(shard) FROM sqlstreams_router.shard) <> shards - 1 THEN
        RAISE EXCEPTION 'sqlstreams router: the shards must be numbered 0 to %', shards - 1 USING ERRCODE = '55000';
    END IF;
    WHILE partitions < shards LOOP
        partitions := partitions * 2;
    END LOOP;
    IF NOT EXISTS (SELECT FROM pg_foreign_server WHERE srvname = 'sqlstreams_shards') THEN
        EXECUTE format('CREATE SERVER sqlstreams_shards FOREIGN DATA WRAPPER plproxy OPTIONS (connection_lifetime %L, p0 %L)',
                       '1800', (SELECT conninfo FROM sqlstreams_router.shard WHERE shard = 0));
        -- No user or password: PL/Proxy connects as the calling role, whose rights the shard
        -- checks (docs/scale-out.md, "Roles"). Any role may call through the router.
        CREATE USER MAPPING FOR PUBLIC SERVER sqlstreams_shards;
        GRANT USAGE ON FOREIGN SERVER sqlstreams_shards TO PUBLIC;
    END IF;
    SELECT coalesce(array_agg(split_part(o, '=', 1)), '{}') INTO known
    FROM pg_foreign_server, unnest(srvoptions) o WHERE srvname = 'sqlstreams_shards';
    FOR p IN 0 .. partitions - 1 LOOP
        options := options || format('%s p%s %L', CASE WHEN format('p%s', p) = ANY (known) THEN 'SET' ELSE 'ADD' END, p,
            (SELECT conninfo FROM sqlstreams_router.shard WHERE shard = CASE WHEN p < shards THEN p ELSE 0 END));
    END LOOP;
    -- All at once: PL/Proxy checks the count of partitions after each ALTER.
    EXECUTE format('ALTER SERVER sqlstreams_shards OPTIONS (%s)', array_to_string(options, ', '));
    RETURN shards;
END
$function$;

-- Adds a shard after the others; returns its number.
CREATE FUNCTION sqlstreams_router.add_shard(conninfo text) RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    added integer;
BEGIN
    IF conninfo ~* 'password' THEN
        RAISE EXCEPTION 'sqlstreams router: a shard''s conninfo holds no password'
            USING ERRCODE = '22023',
                  HINT = 'Every role may read it (sqlstreams_router.locate); give passwords in user mappings (docs/scale-out.md, "Roles").';
    END IF;
    LOCK TABLE sqlstreams_router.shard IN EXCLUSIVE MODE;
    INSERT INTO sqlstreams_router.shard
    VALUES ((SELECT coalesce(max(shard) + 1, 0) FROM sqlstreams_router.shard), conninfo)
    RETURNING shard INTO added;
    PERFORM sqlstreams_router.configure();
    RETURN added;
END
$function$;

-- The shard of `stream`, as placed.
CREATE FUNCTION sqlstreams_router.shard_of(stream text) RETURNS integer
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    placed integer;
BEGIN
    SELECT p.shard INTO placed FROM sqlstreams_router.placement p WHERE p.stream = shard_of.stream;
    IF placed IS NULL THEN
        RAISE EXCEPTION 'sqlstreams: stream "%" does not exist', stream
            USING ERRCODE = '42704',
                  HINT = 'Create it through the router with sqlstreams.create_stream, or place a stream that exists on a shard with sqlstreams_router.place.';
    END IF;
    RETURN placed;
END
$function$;

-- Records where `stream` lives. An admin's (sqlstreams_admin of the router), as creating,
-- dropping and placing streams are.
CREATE FUNCTION sqlstreams_router.record(stream text, shard integer) RETURNS void
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    INSERT INTO sqlstreams_router.placement (stream, shard) VALUES (record.stream, record.shard)
    ON CONFLICT ON CONSTRAINT placement_pkey DO UPDATE SET shard = excluded.shard;
END;

-- Forgets where `stream` lived (it was dropped). An admin's.
CREATE FUNCTION sqlstreams_router.forget(stream text) RETURNS void
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    DELETE FROM sqlstreams_router.placement p WHERE p.stream = forget.stream;
END;

-- Where a stream named `stream` goes: where it is placed, else the shard its name hashes to.
CREATE FUNCTION sqlstreams_router.target_of(stream text) RETURNS integer
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT coalesce((SELECT p.shard FROM sqlstreams_router.placement p WHERE p.stream = target_of.stream),
                    (SELECT (abs(hashtext(target_of.stream)::bigint) % count(*))::integer
                     FROM sqlstreams_router.shard HAVING count(*) > 0));
END;

-- The shard `stream` is placed on, and how to reach it directly (a consumer that LISTENs, a
-- producer that writes its business rows in the same transaction). No secrets: add_shard
-- refuses a password.
CREATE FUNCTION sqlstreams_router.locate(stream text) RETURNS TABLE (shard integer, conninfo text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT s.shard, s.conninfo FROM sqlstreams_router.placement p JOIN sqlstreams_router.shard s USING (shard)
    WHERE p.stream = locate.stream;
END;

-- How many streams named `stream` shard `shard` shows the calling role.
CREATE FUNCTION sqlstreams_router.shown_on(shard integer, stream text) RETURNS bigint
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON shard;
    SELECT count(*) FROM sqlstreams.streams WHERE name = stream;
$$;

-- Places `stream`, which exists on shard `shard` (created there directly, or moved), there.
CREATE FUNCTION sqlstreams_router.place(stream text, shard integer) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
BEGIN
    IF sqlstreams_router.shown_on(shard, stream) = 0 THEN
        RAISE EXCEPTION 'sqlstreams router: shard % has no stream "%" this role may see', shard, stream
            USING ERRCODE = '42704', HINT = 'Create it on that shard first.';
    END IF;
    PERFORM sqlstreams_router.record(stream, shard);
END
$function$;

-- Creating a stream places it first, in the caller's transaction (only an admin may), then
-- creates it on its shard as the calling role (the shard checks that it is an admin there), in a
-- transaction of its own there. If the router's commit fails after the shard's, the stream exists
-- on its shard unplaced, and sqlstreams_router.place mends it.
CREATE FUNCTION sqlstreams_router.create_stream_on_shard(
    name text, partition_size bigint, idempotency_ttl interval, lanes integer
) RETURNS bigint
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(name);
    SELECT sqlstreams.create_stream(name, partition_size, idempotency_ttl, lanes);
$$;

CREATE FUNCTION sqlstreams.create_stream(
    name text,
    partition_size bigint DEFAULT 1000000,
    idempotency_ttl interval DEFAULT '1 day',
    lanes integer DEFAULT 16
) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    target integer := sqlstreams_router.target_of(name);
BEGIN
    IF target IS NULL THEN
        RAISE EXCEPTION 'sqlstreams router: no shard'
            USING ERRCODE = '55000', HINT = 'A superuser adds one with sqlstreams_router.add_shard(conninfo).';
    END IF;
    PERFORM sqlstreams_router.record(name, target);
    RETURN sqlstreams_router.create_stream_on_shard(name, partition_size, idempotency_ttl, lanes);
END
$function$;

CREATE FUNCTION sqlstreams_router.drop_stream_on_shard(name text) RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(name);
    SELECT sqlstreams.drop_stream(name);
$$;

-- A stream the router has not placed is dropped nowhere: false, as a shard answers for one it
-- does not have.
CREATE FUNCTION sqlstreams.drop_stream(name text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    dropped boolean;
BEGIN
    IF NOT EXISTS (SELECT FROM sqlstreams_router.locate(name)) THEN
        RETURN false;
    END IF;
    dropped := sqlstreams_router.drop_stream_on_shard(name);
    PERFORM sqlstreams_router.forget(name);
    RETURN dropped;
END
$function$;

-- Every other call that names a stream runs on its shard, as on one server.
CREATE FUNCTION sqlstreams.create_group(stream text,
    name text,
    concurrency_override text DEFAULT NULL,
    max_retries integer DEFAULT 3,
    start_at text DEFAULT 'beginning',
    backoff_base interval DEFAULT '1 second',
    backoff_cap interval DEFAULT '5 minutes',
    backoff_exponent double precision DEFAULT 2.0,
    max_delays integer DEFAULT NULL,
    max_reclaims integer DEFAULT 2)
RETURNS bigint
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.drop_group(stream text, name text)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.produce(stream text,
    payload jsonb,
    message_key text DEFAULT NULL,
    concurrency text DEFAULT NULL,
    compaction boolean DEFAULT false,
    idempotency_key text DEFAULT NULL,
    headers jsonb DEFAULT NULL,
    deliver_after interval DEFAULT NULL)
RETURNS bigint
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.produce_batch(stream text,
    payloads jsonb[],
    message_keys text[] DEFAULT NULL,
    concurrency text DEFAULT NULL,
    compaction boolean DEFAULT false,
    idempotency_keys text[] DEFAULT NULL,
    headers jsonb[] DEFAULT NULL,
    deliver_after interval DEFAULT NULL)
RETURNS SETOF bigint
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.claim(stream text,
    group_name text,
    batch_size integer DEFAULT 100,
    lease interval DEFAULT '30 seconds',
    ack_lease_token uuid DEFAULT NULL,
    ack_message_ids bigint[] DEFAULT NULL)
RETURNS TABLE (
    message_id bigint,
    message_key text,
    concurrency text,
    attempt integer,
    payload jsonb,
    lease_token uuid,
    run_after bigint
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.claim_with_metadata(stream text,
    group_name text,
    batch_size integer DEFAULT 100,
    lease interval DEFAULT '30 seconds',
    ack_lease_token uuid DEFAULT NULL,
    ack_message_ids bigint[] DEFAULT NULL)
RETURNS TABLE (
    message_id bigint,
    message_key text,
    concurrency text,
    attempt integer,
    payload jsonb,
    lease_token uuid,
    run_after bigint,
    produced_at timestamptz,
    headers jsonb
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.ack(stream text, group_name text, lease_token uuid, message_id bigint)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.ack_batch(stream text, group_name text, lease_token uuid, message_ids bigint[])
RETURNS bigint[]
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.fail(stream text,
    group_name text,
    lease_token uuid,
    message_id bigint,
    error text,
    permanent boolean DEFAULT false,
    retry_after interval DEFAULT NULL)
RETURNS text
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.delay(stream text, group_name text, lease_token uuid, message_id bigint, delay interval)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.extend_lease(stream text,
    group_name text,
    lease_token uuid,
    lease interval DEFAULT '30 seconds')
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.release(stream text, group_name text, lease_token uuid, message_ids bigint[])
RETURNS bigint[]
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.group_status(stream text, group_name text)
RETURNS TABLE (
    claimed bigint,
    committed bigint,
    head bigint,
    lag bigint,
    open_ranges bigint,
    ready bigint,
    inflight bigint,
    deferred bigint,
    dead bigint,
    superseded bigint,
    oldest_unresolved_at timestamptz,
    lost bigint,
    held_back_bytes bigint
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.blocked_keys(stream text, group_name text)
RETURNS TABLE (
    message_key text,
    oldest_message_id bigint,
    status text,
    attempts integer,
    can_run_after timestamptz,
    last_error text,
    waiting_behind bigint
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.dead_messages(stream text, group_name text)
RETURNS TABLE (
    message_id bigint,
    message_key text,
    attempts integer,
    delays integer,
    last_error text,
    died_at timestamptz,
    payload jsonb
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.open_leases(stream text, group_name text)
RETURNS TABLE (
    kind text,
    first_id bigint,
    last_id bigint,
    message_key text,
    lease_token uuid,
    lease_expires_at timestamptz,
    pending integer,
    lane integer
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.next_due(stream text, group_name text)
RETURNS timestamptz
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.grant_stream(stream text, role text, privilege text, group_name text DEFAULT NULL)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.revoke_stream(stream text, role text, privilege text, group_name text DEFAULT NULL)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.break_lease(stream text, group_name text, lease_token uuid)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.peek(stream text, after_id bigint DEFAULT 0, max_messages integer DEFAULT 100)
RETURNS TABLE (message_id bigint, message_key text, produced_at timestamptz, payload jsonb)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.alter_stream(name text, dead_retention interval DEFAULT NULL, idempotency_ttl interval DEFAULT NULL,
    max_age interval DEFAULT NULL, max_bytes bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(name);
$$;

CREATE FUNCTION sqlstreams.alter_group(stream text,
    group_name text,
    concurrency_override text DEFAULT NULL,
    max_retries integer DEFAULT NULL,
    backoff_base interval DEFAULT NULL,
    backoff_cap interval DEFAULT NULL,
    backoff_exponent double precision DEFAULT NULL,
    max_delays integer DEFAULT NULL,
    max_reclaims integer DEFAULT NULL,
    on_dead text DEFAULT NULL,
    max_inflight integer DEFAULT NULL)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.pause_group(stream text, group_name text)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.resume_group(stream text, group_name text)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.redrive(stream text, group_name text, message_ids bigint[] DEFAULT NULL)
RETURNS bigint[]
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.skip(stream text, group_name text, message_id bigint)
RETURNS boolean
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.purge_dead(stream text, group_name text, older_than interval DEFAULT '0 seconds')
RETURNS bigint
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.seek(stream text, group_name text, to_id bigint DEFAULT NULL, to_time timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream);
$$;

CREATE FUNCTION sqlstreams.maintain_stream(stream_name text)
RETURNS TABLE (
    stream text,
    partitions_through bigint,
    idempotency_keys_purged bigint,
    cursors_advanced bigint,
    lane_holds_cleared bigint,
    partitions_dropped bigint,
    exception_rows_purged bigint
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON sqlstreams_router.shard_of(stream_name);
$$;


-- Calls for every shard: each shard in turn, and a shard that does not answer is reported with
-- a warning, so that one shard down stops only its own streams.
CREATE FUNCTION sqlstreams_router.maintain_on(shard integer)
RETURNS TABLE (
    stream text,
    partitions_through bigint,
    idempotency_keys_purged bigint,
    cursors_advanced bigint,
    lane_holds_cleared bigint,
    partitions_dropped bigint,
    exception_rows_purged bigint
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON shard;
    SELECT * FROM sqlstreams.maintain();
$$;

CREATE FUNCTION sqlstreams.maintain()
RETURNS TABLE (
    stream text,
    partitions_through bigint,
    idempotency_keys_purged bigint,
    cursors_advanced bigint,
    lane_holds_cleared bigint,
    partitions_dropped bigint,
    exception_rows_purged bigint
)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    each integer;
BEGIN
    FOR each IN SELECT s.shard FROM sqlstreams_router.shard s ORDER BY 1 LOOP
        BEGIN
            RETURN QUERY SELECT * FROM sqlstreams_router.maintain_on(each);
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'sqlstreams router: shard % did not maintain: %', each, SQLERRM;
        END;
    END LOOP;
END
$function$;

CREATE FUNCTION sqlstreams_router.streams_on(shard integer)
RETURNS TABLE (
    id bigint, name text, partition_size bigint, idempotency_ttl interval, created_at timestamptz, head bigint,
    schema_version text, channel text, lanes integer, dead_retention interval, max_age interval, max_bytes bigint
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON shard;
    SELECT * FROM sqlstreams.streams;
$$;

CREATE FUNCTION sqlstreams_router.consumer_groups_on(shard integer)
RETURNS TABLE (
    id bigint, stream_id bigint, stream text, name text, concurrency_override text, max_retries integer,
    backoff_base interval, backoff_cap interval, backoff_exponent double precision, max_delays integer,
    max_reclaims integer, created_at timestamptz, claimed bigint, committed bigint, head bigint, lag bigint,
    open_ranges bigint, ready bigint, inflight bigint, deferred bigint, dead bigint, superseded bigint,
    paused boolean, on_dead text, oldest_unresolved_at timestamptz, oldest_unresolved_age interval, lost bigint,
    held_back_bytes bigint, max_inflight integer
)
LANGUAGE plproxy AS $$
    CLUSTER 'sqlstreams_shards';
    RUN ON shard;
    SELECT * FROM sqlstreams.consumer_groups;
$$;

-- The shards a view reads, each in turn; one that does not answer is left out with a warning.
CREATE FUNCTION sqlstreams_router.answering(view text) RETURNS SETOF integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    each integer;
BEGIN
    FOR each IN SELECT s.shard FROM sqlstreams_router.shard s ORDER BY 1 LOOP
        BEGIN
            PERFORM sqlstreams_router.shown_on(each, '');
            RETURN NEXT each;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'sqlstreams router: shard % is left out of %: %', each, view, SQLERRM;
        END;
    END LOOP;
END
$function$;

-- The views, with the shard each row came from. Ids are each shard's own, so two streams of two
-- shards may have the same id: name them by name.
CREATE VIEW sqlstreams.streams AS
SELECT a.shard, s.* FROM sqlstreams_router.answering('sqlstreams.streams') a(shard)
CROSS JOIN LATERAL sqlstreams_router.streams_on(a.shard) s;

CREATE VIEW sqlstreams.consumer_groups AS
SELECT a.shard, g.* FROM sqlstreams_router.answering('sqlstreams.consumer_groups') a(shard)
CROSS JOIN LATERAL sqlstreams_router.consumer_groups_on(a.shard) g;

-- Anyone may call the API here; each shard decides what the calling role may do there. The
-- router's tables and its shard list are the superuser's; placing streams is for admins (the
-- role of that name here, as on the shards).
DO $do$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'sqlstreams_admin') THEN
        CREATE ROLE sqlstreams_admin NOLOGIN;
    END IF;
END
$do$;
REVOKE ALL ON ALL TABLES IN SCHEMA sqlstreams_router FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA sqlstreams_router FROM PUBLIC;
GRANT USAGE ON SCHEMA sqlstreams_router, sqlstreams TO PUBLIC;
GRANT EXECUTE ON FUNCTION sqlstreams_router.shard_of(text), sqlstreams_router.target_of(text),
    sqlstreams_router.locate(text), sqlstreams_router.shown_on(integer, text), sqlstreams_router.place(text, integer),
    sqlstreams_router.answering(text), sqlstreams_router.streams_on(integer),
    sqlstreams_router.consumer_groups_on(integer), sqlstreams_router.maintain_on(integer),
    sqlstreams_router.create_stream_on_shard(text, bigint, interval, integer),
    sqlstreams_router.drop_stream_on_shard(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION sqlstreams_router.record(text, integer), sqlstreams_router.forget(text) TO sqlstreams_admin;
GRANT SELECT ON sqlstreams.streams, sqlstreams.consumer_groups TO PUBLIC;
