-- sqlstreams 0.1.0 -> 0.2.0. Written by hand. `scripts/rig test` installs the released 0.1.0,
-- creates streams with messages in every state, runs this script, checks that every row is
-- intact and every function works, and that the catalog equals a fresh 0.2.0 install.
--
-- What changes:
-- - every stream's tables are migrated here (exception_queue gains `isolated`), and each stream
--   records the version of its tables (stream.schema_version); the table family and partitions
--   are now created by SQL functions of the versioned script instead of library code;
-- - quarantined messages are no longer charged a failure: rows quarantined under 0.1.0 that
--   have not run since get the same treatment (isolated, the charge taken back);
-- - every function runs with a pinned search_path;
-- - maintain() also sweeps expired key leases; streams shows schema_version and the channel.

\echo Use "ALTER EXTENSION sqlstreams UPDATE TO '0.2.0'" to load this file. \quit

-- The catalog: which version each stream's tables are.
ALTER TABLE sqlstreams.stream ADD COLUMN schema_version text;
UPDATE sqlstreams.stream SET schema_version = '0.1.0';
ALTER TABLE sqlstreams.stream ALTER COLUMN schema_version SET NOT NULL;

-- The table family, now in the versioned script.
CREATE FUNCTION sqlstreams.create_stream_tables(stream_id bigint) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
BEGIN
    EXECUTE replace($family$
        -- Message ids. CACHE 1 is load-bearing: the claim fence (src/fence.rs) reads last_value
        -- as the highest id handed out, which per-backend caching would break.
        CREATE SEQUENCE sqlstreams.message_log_@id@_seq AS bigint MINVALUE 1 CACHE 1;

        -- The stream itself: append-only, range-partitioned by id (sqlstreams.add_partitions).
        CREATE TABLE sqlstreams.message_log_@id@ (
            id          bigint      NOT NULL,
            message_key text,
            -- The producer's requested concurrency; a group's concurrency_override wins over it.
            concurrency text        CHECK (concurrency IN ('parallel', 'exclusive', 'ordered')),
            compaction  boolean     NOT NULL DEFAULT false,
            payload     jsonb       NOT NULL,
            produced_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (id)
        ) PARTITION BY RANGE (id);

        -- One row per consumer group: the group's cursor and the claim fence's pending observation.
        --   claimed:   every id <= claimed has been handed out in some range.
        --   committed: every id <= committed is resolved for the group; never moves backward.
        --   fence_head/fence_xid: "ids <= fence_head are safe once every transaction older than
        --   fence_xid has ended" (src/fence.rs).
        CREATE TABLE sqlstreams.cursor_@id@ (
            consumer_group_id bigint PRIMARY KEY,
            claimed           bigint NOT NULL,
            committed         bigint NOT NULL,
            fence_head        bigint,
            fence_xid         bigint,
            CHECK (committed <= claimed)
        );

        -- Open range claims: ids first_id .. last_id handed to one consumer under a lease.
        -- pending lists the range's messages without an outcome yet (with their keys, for the
        -- ordered check of other claims). The row is deleted when pending becomes empty.
        CREATE TABLE sqlstreams.range_lease_@id@ (
            consumer_group_id bigint      NOT NULL,
            first_id          bigint      NOT NULL,
            last_id           bigint      NOT NULL,
            lease_token       uuid        NOT NULL,
            lease_expires_at  timestamptz NOT NULL,
            reclaims          int         NOT NULL DEFAULT 0,
            pending           bigint[]    NOT NULL,
            pending_keys      text[]      NOT NULL,
            PRIMARY KEY (consumer_group_id, first_id),
            CHECK (cardinality(pending) = cardinality(pending_keys))
        );

        -- Every (group, message) that left the happy path (docs/semantics.md; the states and
        -- what moves a row between them: src/exception_queue/lifecycle.rs). A waiting row is
        -- "parked": can_run_after is the latest time its blocker could clear on its own, and
        -- resolving the blocker wakes it earlier.
        CREATE TABLE sqlstreams.exception_queue_@id@ (
            consumer_group_id bigint      NOT NULL,
            message_id        bigint      NOT NULL,
            message_key       text,
            concurrency       text        NOT NULL CHECK (concurrency IN ('parallel', 'exclusive', 'ordered')),
            compaction        boolean     NOT NULL DEFAULT false,
            status            text        NOT NULL
                              CHECK (status IN ('ready', 'inflight', 'deferred', 'dead', 'superseded')),
            attempts          int         NOT NULL DEFAULT 0,
            delays            int         NOT NULL DEFAULT 0,
            can_run_after     timestamptz NOT NULL,
            parked            boolean     NOT NULL DEFAULT false,
            last_error        text,
            lease_token       uuid,
            lease_expires_at  timestamptz,
            created_at        timestamptz NOT NULL DEFAULT now(),
            updated_at        timestamptz NOT NULL DEFAULT now(),
            -- (Columns added by upgrades come last, so a fresh install and an upgraded stream
            -- have the same columns in the same order.)
            -- 0.2.0: a message of a quarantined range, handed out alone until it resolves, so
            -- only its own failures and expiries count against it.
            isolated          boolean     NOT NULL DEFAULT false,
            PRIMARY KEY (consumer_group_id, message_id),
            CHECK ((status = 'inflight') = (lease_token IS NOT NULL))
        );
        -- The same-key predecessor lookup (ordered check 1) and the blocked-keys view.
        CREATE INDEX exception_queue_@id@_key_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_key, message_id);
        -- Due work: retries, delays and parked rows whose time has come.
        CREATE INDEX exception_queue_@id@_due_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, can_run_after)
            WHERE status IN ('ready', 'deferred');
        -- Inflight rows whose lease may expire.
        CREATE INDEX exception_queue_@id@_inflight_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, lease_expires_at)
            WHERE status = 'inflight';
        -- The lowest unresolved id bounds the committed cursor.
        CREATE INDEX exception_queue_@id@_unresolved_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_id)
            WHERE status IN ('ready', 'inflight', 'deferred');
        -- Rows a resolution may wake.
        CREATE INDEX exception_queue_@id@_parked_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_key, message_id)
            WHERE parked;
        -- Unresolved messages of quarantined ranges (usually none).
        CREATE INDEX exception_queue_@id@_isolated_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_id)
            WHERE isolated AND status IN ('ready', 'inflight', 'deferred');

        -- Exclusive delivery: one live lease per (group, key).
        CREATE TABLE sqlstreams.message_key_lease_@id@ (
            consumer_group_id bigint      NOT NULL,
            message_key       text        NOT NULL,
            lease_token       uuid        NOT NULL,
            lease_expires_at  timestamptz NOT NULL,
            PRIMARY KEY (consumer_group_id, message_key)
        );

        -- Compaction: the newest compacted message id per key, for every group of the stream.
        CREATE TABLE sqlstreams.compaction_head_@id@ (
            message_key text   PRIMARY KEY,
            message_id  bigint NOT NULL
        );

        -- Idempotent produce: a key seen within the stream's idempotency_ttl produces nothing.
        CREATE TABLE sqlstreams.idempotency_key_@id@ (
            idempotency_key text        PRIMARY KEY,
            message_id      bigint      NOT NULL,
            expires_at      timestamptz NOT NULL
        );
    $family$, '@id@', stream_id::text);
    -- The first partition; produce() adds the next ones ahead of the head.
    PERFORM sqlstreams.add_partitions(stream_id, 1);
END
$function$;

CREATE FUNCTION sqlstreams.drop_stream_tables(stream_id bigint) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
BEGIN
    EXECUTE replace($family$
        DROP TABLE sqlstreams.message_log_@id@, sqlstreams.cursor_@id@, sqlstreams.range_lease_@id@,
                   sqlstreams.exception_queue_@id@, sqlstreams.message_key_lease_@id@,
                   sqlstreams.compaction_head_@id@, sqlstreams.idempotency_key_@id@;
        DROP SEQUENCE sqlstreams.message_log_@id@_seq;
    $family$, '@id@', stream_id::text);
END
$function$;

-- Partitions of message_log_<id>: blocks of partition_size ids, created ahead of the head. A
-- partition is created as a plain table and then attached: ATTACH PARTITION takes only a SHARE
-- UPDATE EXCLUSIVE lock on the parent, which blocks neither producers nor claims, while CREATE
-- TABLE ... PARTITION OF would take an ACCESS EXCLUSIVE lock until the creating transaction
-- commits. Creation is serialized per stream by the stream's catalog row.
CREATE FUNCTION sqlstreams.add_partitions(stream_id bigint, upto bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    size    bigint;
    through bigint;
    part    bigint;
BEGIN
    SELECT s.partition_size, s.partitions_through INTO size, through
    FROM sqlstreams.stream s WHERE s.id = stream_id FOR UPDATE;
    WHILE through <= upto LOOP
        part := (through - 1) / size;
        EXECUTE replace(replace(replace(replace($partition$
            CREATE TABLE sqlstreams.message_log_@id@_p@part@
                (LIKE sqlstreams.message_log_@id@ INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
            ALTER TABLE sqlstreams.message_log_@id@ ATTACH PARTITION sqlstreams.message_log_@id@_p@part@
                FOR VALUES FROM (@from@) TO (@to@);
        $partition$, '@id@', stream_id::text), '@part@', part::text),
            '@from@', (part * size + 1)::text), '@to@', ((part + 1) * size + 1)::text);
        through := (part + 1) * size + 1;
    END LOOP;
    UPDATE sqlstreams.stream s SET partitions_through = through
    WHERE s.id = stream_id AND s.partitions_through <> through;
    RETURN through;
END
$function$;

-- Every existing stream's tables, from 0.1.0 to 0.2.0.
DO $migrate$
DECLARE
    s record;
BEGIN
    FOR s IN SELECT id FROM sqlstreams.stream WHERE schema_version = '0.1.0' ORDER BY id LOOP
        EXECUTE replace($family$
            ALTER TABLE sqlstreams.exception_queue_@id@ ADD COLUMN isolated boolean NOT NULL DEFAULT false;
            CREATE INDEX exception_queue_@id@_isolated_idx
                ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_id)
                WHERE isolated AND status IN ('ready', 'inflight', 'deferred');
            -- 0.1.0 charged each quarantined message a failure before it ever ran alone. Those
            -- that have not run since are quarantined the 0.2.0 way: isolated, the charge taken
            -- back, due at once. A dead one is left for an operator to triage.
            UPDATE sqlstreams.exception_queue_@id@
            SET isolated = true, attempts = attempts - 1, can_run_after = least(can_run_after, now())
            WHERE status = 'ready' AND attempts = 1 AND last_error LIKE 'quarantined: %';
        $family$, '@id@', s.id::text);
        UPDATE sqlstreams.stream SET schema_version = '0.2.0' WHERE id = s.id;
    END LOOP;
END
$migrate$;

-- Every function runs with a pinned search_path.
ALTER FUNCTION sqlstreams.create_stream(text, bigint, interval) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.drop_stream(text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.create_group(text, text, text, integer, text, interval, interval, double precision, integer, integer) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.drop_group(text, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.produce(text, jsonb, text, text, boolean, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.produce_batch(text, jsonb[], text[], text, boolean) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.claim(text, text, integer, interval, uuid, bigint[]) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.ack(text, text, uuid, bigint) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.ack_batch(text, text, uuid, bigint[]) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.fail(text, text, uuid, bigint, text, boolean, interval) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.delay(text, text, uuid, bigint, interval) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.extend_lease(text, text, uuid, interval) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.release(text, text, uuid, bigint[]) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.group_status(text, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.blocked_keys(text, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.dead_messages(text, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.open_leases(text, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION sqlstreams.stream_head(bigint) SET search_path = pg_catalog, pg_temp;

-- maintain() reports the key leases it sweeps.
DROP FUNCTION sqlstreams.maintain();
CREATE FUNCTION sqlstreams.maintain()
RETURNS TABLE (
    stream text,
    partitions_through bigint,
    idempotency_keys_purged bigint,
    cursors_advanced bigint,
    key_leases_swept bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'maintain_wrapper'
SET search_path = pg_catalog, pg_temp;

-- The channel consumers LISTEN on, so clients never spell it themselves.
CREATE FUNCTION sqlstreams.stream_channel(stream_id bigint) RETURNS text
STRICT IMMUTABLE PARALLEL SAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'stream_channel_wrapper'
SET search_path = pg_catalog, pg_temp;

CREATE OR REPLACE VIEW sqlstreams.streams AS
SELECT s.id, s.name, s.partition_size, s.idempotency_ttl, s.created_at,
       sqlstreams.stream_head(s.id) AS head,
       s.schema_version,
       sqlstreams.stream_channel(s.id) AS channel
FROM sqlstreams.stream s;


COMMENT ON VIEW sqlstreams.streams IS
    'Every stream with its id (its tables are named by it), head (highest message id handed out), '
    'the version its tables were built by, and the channel its consumers LISTEN on.';
COMMENT ON FUNCTION sqlstreams.create_stream_tables(bigint) IS
    'Internal: creates the table family of a stream (called by create_stream).';
COMMENT ON FUNCTION sqlstreams.drop_stream_tables(bigint) IS
    'Internal: drops the table family of a stream (called by drop_stream).';
COMMENT ON FUNCTION sqlstreams.add_partitions(bigint, bigint) IS
    'Internal: creates message_log partitions of a stream until they cover upto, and returns the new partitions_through.';
COMMENT ON FUNCTION sqlstreams.produce(text, jsonb, text, text, boolean, text) IS
    'Appends a message in the caller''s transaction and returns its id (NULL for a repeated idempotency_key). '
    'Takes: the stream''s producer lock (shared) and a transaction id before the message id; the key''s '
    'compaction head row until commit.';
COMMENT ON FUNCTION sqlstreams.claim(text, text, integer, interval, uuid, bigint[]) IS
    'Returns the work a consumer may run now under one lease: a claimed range and due exception rows, '
    'in id order; run_after chains same-key rows. Takes: the group''s cursor row until commit (the only '
    'lock it waits for). Call it in its own READ COMMITTED transaction; an idle call writes nothing. '
    'ack_lease_token/ack_message_ids first record successes of an earlier claim (one round trip, one commit).';
COMMENT ON FUNCTION sqlstreams.stream_channel(bigint) IS 'The channel a stream''s consumers LISTEN on; produce NOTIFYs it at commit.';
COMMENT ON FUNCTION sqlstreams.maintain() IS
    'Housekeeping for every stream: partitions ahead of the head, expired idempotency keys, idle groups'' '
    'committed cursors, expired exclusive-key leases. Idempotent; run it from cron at any frequency.';
