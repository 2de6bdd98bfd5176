-- sqlstreams 0.1.0 -> 0.2.0. Written by hand. `scripts/rig test` installs the released 0.1.0,
-- creates streams with messages in every state, runs this script, checks that every row is
-- intact and every function works, and that the catalog equals a fresh 0.2.0 install.
--
-- What changes:
-- - lanes: every message gets a lane (sqlstreams.lane: its key's hash, or blocks of ids), each
--   group a position and a hold per lane; one claim at a time holds a lane for ordered and
--   exclusive work, which replaces the per-key leases (message_key_lease_<id> is dropped). A range
--   open at the upgrade becomes one range per lane of its pending messages, same token.
-- - every stream's tables are migrated here and each stream records the version of its tables
--   (stream.schema_version); the table family and partitions are created by SQL functions of
--   the versioned script instead of library code. Filling the lane of every message rewrites
--   each stream's log once: time the upgrade of a large stream.
-- - quarantined messages are no longer charged a failure: rows quarantined under 0.1.0 that
--   have not run since get the same treatment (isolated, the charge taken back, due at once);
-- - every function runs with a pinned search_path (claim and claim_with_metadata pin it
--   themselves, before their first statement);
-- - maintain() reports the expired lane holds it clears; streams shows schema_version, the
--   channel and the lanes; open_leases shows lanes.
-- - messages carry headers and may be delayed (produce's headers, deliver_after);
--   claim_with_metadata returns produced_at and headers.
-- - retention archives the messages dead letters refer to (message_archive_<id>) as it drops
--   their partitions, so exception rows no longer keep the log's partitions.

\echo Use "ALTER EXTENSION sqlstreams UPDATE TO '0.2.0'" to load this file. \quit

-- The catalog: which version each stream's tables are, and its lanes.
ALTER TABLE sqlstreams.stream ADD COLUMN schema_version text;
UPDATE sqlstreams.stream SET schema_version = '0.1.0';
ALTER TABLE sqlstreams.stream ALTER COLUMN schema_version SET NOT NULL;
ALTER TABLE sqlstreams.stream ADD COLUMN lanes integer NOT NULL DEFAULT 16 CHECK (lanes BETWEEN 1 AND 1024);
ALTER TABLE sqlstreams.stream ADD COLUMN dead_retention interval NOT NULL DEFAULT '7 days';
-- Bounds (src/bounds.rs), NULL: none.
ALTER TABLE sqlstreams.stream ADD COLUMN max_age interval CHECK (max_age > '0'),
    ADD COLUMN max_bytes bigint CHECK (max_bytes > 0);
-- No foreign key to stream: a parallel restore loads the catalog tables in any order
-- (sqlstreams--0.2.0.sql says more).
ALTER TABLE sqlstreams.consumer_group DROP CONSTRAINT consumer_group_stream_id_fkey;
ALTER TABLE sqlstreams.consumer_group ADD COLUMN paused boolean NOT NULL DEFAULT false;
ALTER TABLE sqlstreams.consumer_group ADD COLUMN on_dead text NOT NULL DEFAULT 'release' CHECK (on_dead IN ('release', 'hold'));
ALTER TABLE sqlstreams.consumer_group ADD COLUMN max_inflight int CHECK (max_inflight > 0);

-- The lane of a message: every message of a key lands in one lane (Postgres' own text hash,
-- as hashtext computes it); messages without a key go round in blocks of 64 ids, so a claim's
-- batch of unkeyed messages stays close together in the log. A SQL-standard body: parsed once,
-- inlined into the statements that use it, immune to the caller's search_path. A lane count
-- a stream cannot have (1..1024) is refused, not divided by.
CREATE FUNCTION sqlstreams.lane_count_refused(lanes integer) RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'sqlstreams: lanes must be between 1 and 1024, not %', coalesce(lanes::text, 'NULL')
        USING ERRCODE = 'invalid_parameter_value',
              HINT = 'Pass the stream''s lane count: the lanes column of sqlstreams.streams.';
END
$$;

CREATE FUNCTION sqlstreams.lane(message_key text, message_id bigint, lanes integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN lanes NOT BETWEEN 1 AND 1024 THEN sqlstreams.lane_count_refused(lanes)
            WHEN message_key IS NULL THEN ((message_id / 64) % lanes)::integer
            ELSE ((pg_catalog.hashtext(message_key)::bigint & 4294967295) % lanes)::integer END;

-- The table family, now in the versioned script.
-- Keeps the count rows the library writes and drops any other insert, such as a data-only
-- restore's copy of them (src/exception_queue/counts.rs): the queue's own count triggers count
-- what that restore loads.
CREATE FUNCTION sqlstreams.exception_count_written() RETURNS trigger
LANGUAGE c AS 'MODULE_PATHNAME', 'exception_count_written_wrapper'
SET search_path = pg_catalog, pg_temp;

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
            -- (Columns added by upgrades come last; see exception_queue.)
            -- 0.2.0: sqlstreams.lane(message_key, id, stream.lanes).
            lane        integer     NOT NULL,
            -- 0.2.0: the producer's headers (a JSON object), handed out by claim_with_metadata.
            headers     jsonb,
            -- 0.2.0: not handed out before this time (produce's deliver_after); NULL: at once.
            deliver_at  timestamptz,
            -- The log's only index. A claim takes the next messages of one lane; a message is
            -- found by its lane and id (every reader knows both: a range's lane, an exception
            -- row's). One index per message, not two: a producer writes a third less index WAL.
            PRIMARY KEY (lane, id)
        ) PARTITION BY RANGE (id);

        -- One row per consumer group: the group's cursor and its claim fence (src/fence.rs).
        --   claimed:   every id <= claimed has been handed out in some range (the lanes' lowest
        --              position; stored by maintain(), computed live by group_status).
        --   committed: every id <= committed is resolved for the group; never moves backward but
        --              for a seek, or a redrive of a dead message at or below it.
        --   fence_head/fence_xid: a pending observation, "ids <= fence_head are safe once every
        --              transaction older than fence_xid has ended".
        --   fence_safe: every id <= fence_safe is proven safe (committed or rolled back).
        CREATE TABLE sqlstreams.cursor_@id@ (
            consumer_group_id bigint PRIMARY KEY,
            claimed           bigint NOT NULL,
            committed         bigint NOT NULL,
            fence_head        bigint,
            fence_xid         bigint,
            -- 0.2.0
            fence_safe        bigint NOT NULL DEFAULT 0,
            -- 0.2.0: messages a stream's bound dropped before the group consumed them.
            lost              bigint NOT NULL DEFAULT 0,
            CHECK (committed <= claimed)
        );

        -- Each group's position in each lane, and which claim holds the lane. A group whose
        -- messages may be ordered or exclusive hands out one claim's deliveries per lane at a
        -- time (held_by, until held_until or until they all resolve): every message of a key
        -- is in one lane, so no two consumers ever hold the same key.
        CREATE TABLE sqlstreams.lane_@id@ (
            consumer_group_id bigint      NOT NULL,
            lane              integer     NOT NULL,
            -- Every message of this lane with id <= claimed has been handed out.
            claimed           bigint      NOT NULL,
            held_by           uuid,
            held_until        timestamptz,
            PRIMARY KEY (consumer_group_id, lane)
            -- No CHECK that held_by and held_until are both set or both NULL: the statements
            -- that write them keep it so (src/lanes/holds.rs, src/lease.rs, seek, maintain), and a
            -- CHECK is compiled anew by every statement that writes the table, as every claim does.
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
            -- 0.2.0: the lane every message of the range is in.
            lane              integer     NOT NULL,
            PRIMARY KEY (consumer_group_id, first_id)
            -- One key (or NULL) per pending id: src/range.rs writes the two arrays together.
            -- Not a CHECK: a CHECK is compiled anew by every statement that writes the table,
            -- as every claim does.
        );
        -- 0.2.0: a claim's ranges, found by its token (outcomes, lane releases) in one probe
        -- however many ranges other claims opened and closed since the last vacuum.
        CREATE INDEX range_lease_@id@_token_idx ON sqlstreams.range_lease_@id@ (consumer_group_id, lease_token);
        -- 0.2.0: expired ranges, found without visiting every range closed since the last vacuum.
        CREATE INDEX range_lease_@id@_expiry_idx ON sqlstreams.range_lease_@id@ (consumer_group_id, lease_expires_at);

        -- 0.2.0: the messages of open ranges that have an outcome, under the lease token they
        -- were delivered with (src/range.rs). An outcome adds rows here rather than rewrite its
        -- range's row, and the range goes with its rows once every message of it has one.
        CREATE TABLE sqlstreams.range_done_@id@ (
            consumer_group_id bigint NOT NULL,
            lease_token       uuid   NOT NULL,
            message_id        bigint NOT NULL,
            PRIMARY KEY (consumer_group_id, lease_token, message_id)
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
            -- 0.2.0: the message's lane.
            lane              integer     NOT NULL,
            PRIMARY KEY (consumer_group_id, message_id),
            CHECK ((status = 'inflight') = (lease_token IS NOT NULL))
        );
        -- The same-key predecessor lookup (ordered check 1) and the blocked-keys view.
        CREATE INDEX exception_queue_@id@_key_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_key, message_id);
        -- Due work of a lane: retries, delays and parked rows whose time has come.
        CREATE INDEX exception_queue_@id@_due_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, lane, can_run_after)
            WHERE status IN ('ready', 'deferred');
        -- Inflight rows of a lane whose lease may expire.
        CREATE INDEX exception_queue_@id@_inflight_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, lane, lease_expires_at)
            WHERE status = 'inflight';
        -- The lowest unresolved id bounds the committed cursor.
        CREATE INDEX exception_queue_@id@_unresolved_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_id)
            WHERE status IN ('ready', 'inflight', 'deferred');
        -- Rows a resolution may wake.
        CREATE INDEX exception_queue_@id@_parked_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_key, message_id)
            WHERE parked;
        -- 0.2.0: a key's first row that runs or retries, which the wake-up of an ordered key
        -- looks for in one probe however many rows are parked behind it.
        CREATE INDEX exception_queue_@id@_runnable_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_key, message_id)
            WHERE status IN ('ready', 'inflight') AND NOT parked;
        -- 0.2.0: whether a group has anything due at all, in one probe however many rows wait
        -- for a later time (the idle claim's question).
        CREATE INDEX exception_queue_@id@_due_any_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, can_run_after)
            WHERE status IN ('ready', 'deferred');
        CREATE INDEX exception_queue_@id@_expiry_any_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, lease_expires_at)
            WHERE status = 'inflight';
        -- Unresolved messages of quarantined ranges (usually none).
        CREATE INDEX exception_queue_@id@_isolated_idx
            ON sqlstreams.exception_queue_@id@ (consumer_group_id, lane, message_id)
            WHERE isolated AND status IN ('ready', 'inflight', 'deferred');

        -- 0.2.0: how many exception rows each group has in each status, so group_status reads
        -- a few rows, not the queue. Statement triggers on the queue pass what a statement
        -- changed to the library, which adds it up per transaction and, just before the
        -- transaction commits, adds the sums to the backend's own row (`writer`, its pid) for
        -- each group and status: one HOT update per group and status a transaction changed,
        -- however many statements changed them, and no writer waits for another (a row it
        -- cannot lock at once gets a new row beside it). Retention (src/retention.rs) folds
        -- each group's rows into one per status. See src/exception_queue/counts.rs. The
        -- commit writes the table after deferred triggers have run, so it has one BEFORE
        -- trigger only, which drops rows the library did not write (a data-only restore's).
        CREATE TABLE sqlstreams.exception_count_@id@ (
            consumer_group_id bigint  NOT NULL,
            status            text    NOT NULL,
            delta             bigint  NOT NULL,
            writer            integer
        );
        CREATE INDEX exception_count_@id@_group_idx
            ON sqlstreams.exception_count_@id@ (consumer_group_id, status, writer);
        -- No key (a writer may have two rows): the whole old row identifies one for a FOR ALL
        -- TABLES publication, which refuses updates and deletes of a table without either.
        ALTER TABLE sqlstreams.exception_count_@id@ REPLICA IDENTITY FULL;
        CREATE TRIGGER exception_count_restored BEFORE INSERT ON sqlstreams.exception_count_@id@
            FOR EACH ROW EXECUTE FUNCTION sqlstreams.exception_count_written();
        CREATE FUNCTION sqlstreams.exception_count_@id@() RETURNS trigger
        LANGUAGE plpgsql
        SET search_path = pg_catalog, pg_temp
        AS $count$
        DECLARE
            groups   bigint[];
            statuses text[];
            deltas   bigint[];
        BEGIN
            -- What the statement changed, per group and status.
            IF TG_OP = 'INSERT' THEN
                SELECT array_agg(consumer_group_id), array_agg(status), array_agg(n) INTO groups, statuses, deltas
                FROM (SELECT consumer_group_id, status, count(*) AS n FROM added GROUP BY 1, 2) c;
            ELSIF TG_OP = 'DELETE' THEN
                SELECT array_agg(consumer_group_id), array_agg(status), array_agg(n) INTO groups, statuses, deltas
                FROM (SELECT consumer_group_id, status, -count(*) AS n FROM removed GROUP BY 1, 2) c;
            ELSE
                SELECT array_agg(consumer_group_id), array_agg(status), array_agg(n) INTO groups, statuses, deltas
                FROM (SELECT consumer_group_id, status, sum(d) AS n
                      FROM (SELECT consumer_group_id, status, 1 AS d FROM added
                            UNION ALL
                            SELECT consumer_group_id, status, -1 FROM removed) u
                      GROUP BY 1, 2 HAVING sum(d) <> 0) c;
            END IF;
            -- Added up in this backend and written once, just before the transaction commits
            -- (src/exception_queue/counts.rs).
            IF groups IS NOT NULL THEN
                PERFORM sqlstreams.exception_counts_changed(@id@, groups, statuses, deltas);
            END IF;
            RETURN NULL;
        END
        $count$;
        REVOKE ALL ON FUNCTION sqlstreams.exception_count_@id@() FROM PUBLIC;
        COMMENT ON FUNCTION sqlstreams.exception_count_@id@() IS
            'Keeps exception_count_@id@ in step with exception_queue_@id@ (statement triggers).';
        CREATE TRIGGER exception_count_added AFTER INSERT ON sqlstreams.exception_queue_@id@
            REFERENCING NEW TABLE AS added
            FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.exception_count_@id@();
        CREATE TRIGGER exception_count_changed AFTER UPDATE ON sqlstreams.exception_queue_@id@
            REFERENCING OLD TABLE AS removed NEW TABLE AS added
            FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.exception_count_@id@();
        CREATE TRIGGER exception_count_removed AFTER DELETE ON sqlstreams.exception_queue_@id@
            REFERENCING OLD TABLE AS removed
            FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.exception_count_@id@();

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

        -- 0.2.0: the messages exception rows still refer to after retention dropped their
        -- partition (dead letters, kept for redrive and inspection; src/retention.rs), so no
        -- row pins the log's partitions and the claim path only opens partitions a group needs.
        CREATE TABLE sqlstreams.message_archive_@id@
            (LIKE sqlstreams.message_log_@id@ INCLUDING DEFAULTS INCLUDING CONSTRAINTS, PRIMARY KEY (id));
        -- The exception queue is a visible table (docs/sql-api.md): readable by admins and monitors.
        GRANT SELECT ON sqlstreams.exception_queue_@id@ TO sqlstreams_admin, pg_monitor;
    $family$, '@id@', stream_id::text);
    -- The first partition; claims and maintain() add the next ones ahead of the head.
    PERFORM sqlstreams.add_partitions(stream_id, 1, true);
END
$function$;

CREATE FUNCTION sqlstreams.drop_stream_tables(stream_id bigint) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
BEGIN
    EXECUTE replace($family$
        DROP TABLE sqlstreams.message_log_@id@, sqlstreams.cursor_@id@, sqlstreams.lane_@id@,
                   sqlstreams.range_lease_@id@, sqlstreams.range_done_@id@, sqlstreams.exception_queue_@id@,
                   sqlstreams.compaction_head_@id@, sqlstreams.idempotency_key_@id@,
                   sqlstreams.exception_count_@id@, sqlstreams.message_archive_@id@;
        DROP FUNCTION sqlstreams.exception_count_@id@();
        DROP SEQUENCE sqlstreams.message_log_@id@_seq;
    $family$, '@id@', stream_id::text);
END
$function$;

-- Partitions of message_log_<id>: blocks of partition_size ids, created ahead of the head by
-- claims and maintain() (without waiting: `wait` false), and by a producer only for an id no
-- partition holds yet (src/partition.rs). A partition is created as a plain table and then
-- attached: ATTACH PARTITION takes only a SHARE UPDATE EXCLUSIVE lock on the parent, which
-- blocks neither producers nor claims, while CREATE TABLE ... PARTITION OF would take an ACCESS
-- EXCLUSIVE lock until the creating transaction commits. Creation is serialized per stream by
-- the stream's catalog row. Returns the new partitions_through (NULL when skipped).
CREATE FUNCTION sqlstreams.add_partitions(stream_id bigint, upto bigint, wait boolean) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    size    bigint;
    through bigint;
    part    bigint;
    timeout text;
BEGIN
    -- A fresh look first: another transaction may have added them since the caller read the
    -- stream row, and then nothing is locked (a long producer transaction holding the stream
    -- row would hold every producer back).
    SELECT s.partitions_through INTO through FROM sqlstreams.stream s WHERE s.id = stream_id;
    IF through > upto THEN
        RETURN through;
    END IF;
    IF wait THEN
        SELECT s.partition_size, s.partitions_through INTO size, through
        FROM sqlstreams.stream s WHERE s.id = stream_id FOR NO KEY UPDATE;
    ELSE
        -- Another transaction is creating partitions of this stream: leave it to that one.
        SELECT s.partition_size, s.partitions_through INTO size, through
        FROM sqlstreams.stream s WHERE s.id = stream_id FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        -- Ahead of need (claims, maintain): not even the log's lock is waited for (a manual
        -- ANALYZE or index build of the log holds it); the next caller tries again.
        timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', '1ms', true);
    END IF;
    BEGIN
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
    EXCEPTION WHEN lock_not_available THEN
        IF wait THEN
            RAISE;
        END IF;
        PERFORM set_config('lock_timeout', timeout, true);
        RETURN NULL;
    END;
    IF NOT wait THEN
        PERFORM set_config('lock_timeout', timeout, true);
    END IF;
    UPDATE sqlstreams.stream s SET partitions_through = through
    WHERE s.id = stream_id AND s.partitions_through <> through;
    RETURN through;
END
$function$;

-- The log of a stream, locked ACCESS EXCLUSIVE until commit if it can be within 20 ms
-- (src/bounds.rs): waiting longer would queue every producer and claim of the stream behind
-- this one. Returns whether it is locked.
CREATE FUNCTION sqlstreams.lock_log(stream_id bigint) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '20ms', true);
    BEGIN
        EXECUTE format('LOCK TABLE sqlstreams.message_log_%s IN ACCESS EXCLUSIVE MODE', stream_id);
    EXCEPTION
        WHEN lock_not_available OR deadlock_detected THEN
            PERFORM set_config('lock_timeout', timeout, true);
            RETURN false;
    END;
    PERFORM set_config('lock_timeout', timeout, true);
    RETURN true;
END
$function$;

-- A stream's head: its id sequence's last value, read under the sequence's buffer lock
-- (src/head.rs). A SELECT of last_value can see the value nextval logs ahead, an id not handed
-- out yet. Claims read it without this function; inspection, seek and create_group through it.
-- VOLATILE: the head moves while a statement runs, and a statement that names it once must read
-- it once (a STABLE call in a subquery that is pulled up runs once per reference). It writes
-- nothing: a hot standby runs it too (tests/standby).
CREATE FUNCTION sqlstreams.log_head(stream_id bigint) RETURNS bigint
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'log_head_wrapper'
SET search_path = pg_catalog, pg_temp;

-- Retention (src/retention.rs): drops the partitions of message_log_<id> whose every id is at
-- or below `below` (no group needs them any more), oldest first, at most 8 per call. First, in
-- one pass and before any drop locks the log, the messages of those partitions that exception
-- rows still refer to (dead letters) are copied to message_archive_<id>. Dropping a partition
-- locks the whole log until commit, so the lock is never waited for long (the next caller tries
-- again); under it, each drop checks again that every group is past the partition (a seek
-- backwards or a new group may have moved since `below` was read). Returns how many were
-- dropped.
CREATE FUNCTION sqlstreams.drop_partitions(stream_id bigint, below bigint) RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    size    bigint;
    part    record;
    upto    bigint;
    needed  bigint;
    dropped integer := 0;
    timeout text := current_setting('lock_timeout');
BEGIN
    SELECT s.partition_size INTO size FROM sqlstreams.stream s WHERE s.id = stream_id;
    -- The end of the last partition that may go this time.
    SELECT max((p.n + 1) * size) INTO upto
    FROM (SELECT substring(c.relname FROM '_p([0-9]+)$')::bigint AS n
          FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = format('sqlstreams.message_log_%s', stream_id)::regclass
          ORDER BY 1 LIMIT 8) p
    WHERE (p.n + 1) * size <= below;
    IF upto IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM set_config('lock_timeout', '20ms', true);
    BEGIN
        -- Superseded rows are never handed out again: their payloads are not needed.
        EXECUTE format($archive$
            INSERT INTO sqlstreams.message_archive_%1$s
            SELECT m.* FROM sqlstreams.message_log_%1$s m
            WHERE m.id <= %2$s
              AND (m.lane, m.id) IN (SELECT e.lane, e.message_id FROM sqlstreams.exception_queue_%1$s e
                           WHERE e.message_id <= %2$s AND e.status <> 'superseded')
            ON CONFLICT (id) DO NOTHING$archive$, stream_id, upto);
    EXCEPTION
        WHEN OTHERS THEN
            -- A concurrent step archiving the same rows, for example: the next step goes on.
            -- Retention must never fail the claim or maintain() that runs it.
            IF SQLSTATE NOT IN ('55P03', '40P01') THEN
                RAISE WARNING 'sqlstreams: messages of stream % not archived: %', stream_id, SQLERRM;
            END IF;
            PERFORM set_config('lock_timeout', timeout, true);
            RETURN 0;
    END;
    FOR part IN
        SELECT c.relname, substring(c.relname FROM '_p([0-9]+)$')::bigint AS n
        FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = format('sqlstreams.message_log_%s', stream_id)::regclass
        ORDER BY 2
    LOOP
        EXIT WHEN (part.n + 1) * size > upto;
        BEGIN
            EXECUTE format('LOCK TABLE sqlstreams.message_log_%s IN ACCESS EXCLUSIVE MODE', stream_id);
            EXECUTE format('SELECT min(committed) FROM sqlstreams.cursor_%s', stream_id) INTO needed;
            EXIT WHEN needed IS NULL OR (part.n + 1) * size > needed;
            EXECUTE format('DROP TABLE sqlstreams.%I', part.relname);
            dropped := dropped + 1;
        EXCEPTION
            -- Another step holds the log (both read it, then both ask for it whole: Postgres
            -- reports the deadlock at once, before lock_timeout): the next step drops it.
            WHEN lock_not_available OR deadlock_detected THEN
                EXIT;
            WHEN OTHERS THEN
                -- For example a view of the user's that depends on the partition: retention
                -- must never fail the claim or maintain() that runs it.
                RAISE WARNING 'sqlstreams: partition % not dropped: %', part.relname, SQLERRM;
                EXIT;
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', timeout, true);
    RETURN dropped;
END
$function$;


----------------------------------------------------------------------------------------------
-- Roles and grants (src/access.rs): functions are granted to three roles, never to PUBLIC,
-- and what a role may touch is granted per stream. Roles belong to the cluster: the first
-- database to install the extension creates them, later ones reuse them, and DROP EXTENSION
-- leaves them.
----------------------------------------------------------------------------------------------

-- A CREATE EXTENSION in another database at the same time may be creating them too: its
-- roles are not visible until it commits, so this one's CREATE ROLE waits for it and then finds
-- the name taken (23505), which means the role exists.
DO $roles$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['sqlstreams_admin', 'sqlstreams_producer', 'sqlstreams_consumer'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN unique_violation OR duplicate_object THEN
                NULL;
            END;
        END IF;
    END LOOP;
END
$roles$;

-- Who may produce to a stream, or consume as one of its groups (every group when group_name
-- is NULL). Granted and revoked with sqlstreams.grant_stream / revoke_stream. The grantee is a
-- regrole: pg_dump writes the role's name, so a restore into another cluster, whose roles have
-- other oids, gives each grant back to the role of that name (and fails on a missing role). No
-- foreign key to stream, as for consumer_group.
CREATE TABLE sqlstreams.stream_grant (
    stream_id  bigint      NOT NULL,
    grantee    regrole     NOT NULL,
    privilege  text        NOT NULL CHECK (privilege IN ('produce', 'consume')),
    group_name text        CHECK (group_name IS NULL OR privilege = 'consume'),
    granted_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE NULLS NOT DISTINCT (stream_id, grantee, privilege, group_name)
);
-- A dropped role's grants stay behind (Postgres does not know them); dumped, they would name a
-- bare oid, which a restore gives to whichever role has it there. They are not dumped.
SELECT pg_catalog.pg_extension_config_dump('sqlstreams.stream_grant',
    'WHERE grantee OPERATOR(pg_catalog.=) ANY (SELECT oid FROM pg_catalog.pg_roles)');
-- Without a key, a database's FOR ALL TABLES publication (change data capture, a migration)
-- would refuse every revoke and drop_stream; the whole old row identifies one instead.
ALTER TABLE sqlstreams.stream_grant REPLICA IDENTITY FULL;

-- Backends remember what these three tables say (src/catalog.rs) until an invalidation tells
-- them to forget it: every row changed sends one, with its transaction. Row triggers, because
-- logical replication's apply workers fire no statement triggers; fired always, whatever
-- session_replication_role says.
CREATE FUNCTION sqlstreams.catalog_changed() RETURNS trigger
LANGUAGE c AS 'MODULE_PATHNAME', 'catalog_changed_wrapper'
SET search_path = pg_catalog, pg_temp;
CREATE TRIGGER catalog_changed BEFORE INSERT OR UPDATE OR DELETE ON sqlstreams.stream
    FOR EACH ROW EXECUTE FUNCTION sqlstreams.catalog_changed();
CREATE TRIGGER catalog_truncated BEFORE TRUNCATE ON sqlstreams.stream
    FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.catalog_changed();
CREATE TRIGGER catalog_changed BEFORE INSERT OR UPDATE OR DELETE ON sqlstreams.consumer_group
    FOR EACH ROW EXECUTE FUNCTION sqlstreams.catalog_changed();
CREATE TRIGGER catalog_truncated BEFORE TRUNCATE ON sqlstreams.consumer_group
    FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.catalog_changed();
CREATE TRIGGER catalog_changed BEFORE INSERT OR UPDATE OR DELETE ON sqlstreams.stream_grant
    FOR EACH ROW EXECUTE FUNCTION sqlstreams.catalog_changed();
CREATE TRIGGER catalog_truncated BEFORE TRUNCATE ON sqlstreams.stream_grant
    FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.catalog_changed();
ALTER TABLE sqlstreams.stream ENABLE ALWAYS TRIGGER catalog_changed, ENABLE ALWAYS TRIGGER catalog_truncated;
ALTER TABLE sqlstreams.consumer_group ENABLE ALWAYS TRIGGER catalog_changed, ENABLE ALWAYS TRIGGER catalog_truncated;
ALTER TABLE sqlstreams.stream_grant ENABLE ALWAYS TRIGGER catalog_changed, ENABLE ALWAYS TRIGGER catalog_truncated;

-- The exception counts' statement triggers pass each statement's changes here; the library adds
-- them up and writes them once, just before the transaction commits
-- (src/exception_queue/counts.rs). Internal: only the triggers call it.
CREATE FUNCTION sqlstreams.exception_counts_changed(stream_id bigint, groups bigint[], statuses text[], deltas bigint[])
RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'exception_counts_changed_wrapper'
SET search_path = pg_catalog, pg_temp;

-- Every existing stream's tables, from 0.1.0 to 0.2.0.
DO $migrate$
DECLARE
    s record;
BEGIN
    FOR s IN SELECT id, lanes FROM sqlstreams.stream WHERE schema_version = '0.1.0' ORDER BY id LOOP
        EXECUTE replace(replace($family$
            -- Every message's lane. The lane and id become the log's key (its only index), as in
            -- create_stream_tables; the old key goes first, so the update does not maintain it.
            -- Between the two keys the whole row identifies a partition's row to a publication
            -- of the log (FOR ALL TABLES), which refuses an update of a table without either.
            ALTER TABLE sqlstreams.message_log_@id@ DROP CONSTRAINT message_log_@id@_pkey,
                ADD COLUMN lane integer;
            DO $full$
            DECLARE
                part regclass;
            BEGIN
                FOR part IN SELECT inhrelid::regclass FROM pg_catalog.pg_inherits
                            WHERE inhparent OPERATOR(pg_catalog.=) 'sqlstreams.message_log_@id@'::regclass LOOP
                    EXECUTE pg_catalog.format('ALTER TABLE %s REPLICA IDENTITY FULL', part);
                END LOOP;
            END $full$;
            UPDATE sqlstreams.message_log_@id@ SET lane = sqlstreams.lane(message_key, id, @lanes@);
            ALTER TABLE sqlstreams.message_log_@id@ ALTER COLUMN lane SET NOT NULL,
                ADD PRIMARY KEY (lane, id);
            DO $default$
            DECLARE
                part regclass;
            BEGIN
                FOR part IN SELECT inhrelid::regclass FROM pg_catalog.pg_inherits
                            WHERE inhparent OPERATOR(pg_catalog.=) 'sqlstreams.message_log_@id@'::regclass LOOP
                    EXECUTE pg_catalog.format('ALTER TABLE %s REPLICA IDENTITY DEFAULT', part);
                END LOOP;
            END $default$;
            -- Headers and delayed delivery: NULL for every message produced so far.
            ALTER TABLE sqlstreams.message_log_@id@ ADD COLUMN headers jsonb, ADD COLUMN deliver_at timestamptz;

            -- The fence's proven head starts with nothing proven: a group created at the head
            -- never proved its cursor, and each group's first claim proves what is safe.
            ALTER TABLE sqlstreams.cursor_@id@ ADD COLUMN fence_safe bigint NOT NULL DEFAULT 0;
            ALTER TABLE sqlstreams.cursor_@id@ ADD COLUMN lost bigint NOT NULL DEFAULT 0;

            -- Each group's lanes start where its cursor is.
            CREATE TABLE sqlstreams.lane_@id@ (
                consumer_group_id bigint      NOT NULL,
                lane              integer     NOT NULL,
                -- Every message of this lane with id <= claimed has been handed out.
                claimed           bigint      NOT NULL,
                held_by           uuid,
                held_until        timestamptz,
                PRIMARY KEY (consumer_group_id, lane)
                -- No CHECK that held_by and held_until are both set or both NULL: the statements
                -- that write them keep it so (src/lanes/holds.rs, src/lease.rs, seek, maintain), and a
                -- CHECK is compiled anew by every statement that writes the table, as every claim does.
            );
            -- Created by this script, it would belong to the extension; a stream's tables do not
            -- (pg_dump keeps them).
            ALTER EXTENSION sqlstreams DROP TABLE sqlstreams.lane_@id@;
            INSERT INTO sqlstreams.lane_@id@ (consumer_group_id, lane, claimed)
            SELECT c.consumer_group_id, l, c.claimed FROM sqlstreams.cursor_@id@ c, generate_series(0, @lanes@ - 1) l;

            ALTER TABLE sqlstreams.range_lease_@id@ ADD COLUMN lane integer,
                -- Every claim inserts a range: a CHECK would be compiled for each (as created).
                DROP CONSTRAINT range_lease_@id@_check;
            -- Ranges open now were claimed across lanes: each becomes one range per lane of its
            -- pending messages, under the same token, expiry and reclaims, so that every range is
            -- in one lane. The row keeps the lane of its oldest pending message; the other lanes'
            -- messages get rows of their own, keyed by their oldest message.
            INSERT INTO sqlstreams.range_lease_@id@
                (consumer_group_id, first_id, last_id, lease_token, lease_expires_at, reclaims, pending, pending_keys, lane)
            SELECT r.consumer_group_id, min(p.id), r.last_id, r.lease_token, r.lease_expires_at, r.reclaims,
                   array_agg(p.id ORDER BY p.id), array_agg(p.key ORDER BY p.id), p.lane
            FROM sqlstreams.range_lease_@id@ r
            CROSS JOIN LATERAL (SELECT sqlstreams.lane(u.key, u.id, @lanes@) AS lane
                                FROM unnest(r.pending, r.pending_keys) AS u(id, key) ORDER BY u.id LIMIT 1) f
            CROSS JOIN LATERAL (SELECT u.id, u.key, sqlstreams.lane(u.key, u.id, @lanes@) AS lane
                                FROM unnest(r.pending, r.pending_keys) AS u(id, key)) p
            WHERE r.lane IS NULL AND p.lane <> f.lane
            GROUP BY r.consumer_group_id, r.first_id, r.last_id, r.lease_token, r.lease_expires_at, r.reclaims, p.lane;
            UPDATE sqlstreams.range_lease_@id@ r
            SET lane = k.lane, pending = k.pending, pending_keys = k.pending_keys
            FROM (SELECT r.consumer_group_id, r.first_id, f.lane,
                         array_agg(u.id ORDER BY u.id) AS pending, array_agg(u.key ORDER BY u.id) AS pending_keys
                  FROM sqlstreams.range_lease_@id@ r
                  CROSS JOIN LATERAL (SELECT sqlstreams.lane(u.key, u.id, @lanes@) AS lane
                                      FROM unnest(r.pending, r.pending_keys) AS u(id, key) ORDER BY u.id LIMIT 1) f
                  CROSS JOIN LATERAL unnest(r.pending, r.pending_keys) AS u(id, key)
                  WHERE r.lane IS NULL AND sqlstreams.lane(u.key, u.id, @lanes@) = f.lane
                  GROUP BY r.consumer_group_id, r.first_id, f.lane) k
            WHERE r.consumer_group_id = k.consumer_group_id AND r.first_id = k.first_id;
            ALTER TABLE sqlstreams.range_lease_@id@ ALTER COLUMN lane SET NOT NULL;
            CREATE INDEX range_lease_@id@_token_idx ON sqlstreams.range_lease_@id@ (consumer_group_id, lease_token);
            CREATE INDEX range_lease_@id@_expiry_idx ON sqlstreams.range_lease_@id@ (consumer_group_id, lease_expires_at);
            -- Outcomes of open ranges' messages: none yet, each range lists only its pending ones.
            CREATE TABLE sqlstreams.range_done_@id@ (
                consumer_group_id bigint NOT NULL,
                lease_token       uuid   NOT NULL,
                message_id        bigint NOT NULL,
                PRIMARY KEY (consumer_group_id, lease_token, message_id)
            );
            ALTER EXTENSION sqlstreams DROP TABLE sqlstreams.range_done_@id@;

            -- Exception rows: isolated (quarantine), and their message's lane.
            ALTER TABLE sqlstreams.exception_queue_@id@ ADD COLUMN isolated boolean NOT NULL DEFAULT false;
            ALTER TABLE sqlstreams.exception_queue_@id@ ADD COLUMN lane integer;
            UPDATE sqlstreams.exception_queue_@id@ SET lane = sqlstreams.lane(message_key, message_id, @lanes@);
            GRANT SELECT ON sqlstreams.exception_queue_@id@ TO sqlstreams_admin, pg_monitor;
            ALTER TABLE sqlstreams.exception_queue_@id@ ALTER COLUMN lane SET NOT NULL;
            -- 0.1.0's due and inflight indexes are 0.2.0's "anything due at all" indexes, under
            -- new names (no rebuild); the per-lane ones are new.
            ALTER INDEX sqlstreams.exception_queue_@id@_due_idx RENAME TO exception_queue_@id@_due_any_idx;
            ALTER INDEX sqlstreams.exception_queue_@id@_inflight_idx RENAME TO exception_queue_@id@_expiry_any_idx;
            CREATE INDEX exception_queue_@id@_due_idx
                ON sqlstreams.exception_queue_@id@ (consumer_group_id, lane, can_run_after)
                WHERE status IN ('ready', 'deferred');
            CREATE INDEX exception_queue_@id@_inflight_idx
                ON sqlstreams.exception_queue_@id@ (consumer_group_id, lane, lease_expires_at)
                WHERE status = 'inflight';
            CREATE INDEX exception_queue_@id@_isolated_idx
                ON sqlstreams.exception_queue_@id@ (consumer_group_id, lane, message_id)
                WHERE isolated AND status IN ('ready', 'inflight', 'deferred');
            CREATE INDEX exception_queue_@id@_runnable_idx
                ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_key, message_id)
                WHERE status IN ('ready', 'inflight') AND NOT parked;
            -- 0.1.0 charged each quarantined message a failure before it ever ran alone. Those
            -- that have not run since are quarantined the 0.2.0 way: isolated, the charge taken
            -- back, due at once. A dead one is left for an operator to triage.
            UPDATE sqlstreams.exception_queue_@id@
            SET isolated = true, attempts = attempts - 1, can_run_after = least(can_run_after, now())
            WHERE status = 'ready' AND attempts = 1 AND last_error LIKE 'quarantined: %';

            -- Lanes hold keys now; a delivery in flight under a 0.1.0 key lease is still seen by
            -- the gate (in its range's pending list, or as an inflight row).
            DROP TABLE sqlstreams.message_key_lease_@id@;

            -- The exception counts, as the install script writes them (the same text, so the
            -- trigger function is the same), seeded with the rows there are.
        -- 0.2.0: how many exception rows each group has in each status, so group_status reads
        -- a few rows, not the queue. Statement triggers on the queue pass what a statement
        -- changed to the library, which adds it up per transaction and, just before the
        -- transaction commits, adds the sums to the backend's own row (`writer`, its pid) for
        -- each group and status: one HOT update per group and status a transaction changed,
        -- however many statements changed them, and no writer waits for another (a row it
        -- cannot lock at once gets a new row beside it). Retention (src/retention.rs) folds
        -- each group's rows into one per status. See src/exception_queue/counts.rs. The
        -- commit writes the table after deferred triggers have run, so it has one BEFORE
        -- trigger only, which drops rows the library did not write (a data-only restore's).
        CREATE TABLE sqlstreams.exception_count_@id@ (
            consumer_group_id bigint  NOT NULL,
            status            text    NOT NULL,
            delta             bigint  NOT NULL,
            writer            integer
        );
        CREATE INDEX exception_count_@id@_group_idx
            ON sqlstreams.exception_count_@id@ (consumer_group_id, status, writer);
        -- No key (a writer may have two rows): the whole old row identifies one for a FOR ALL
        -- TABLES publication, which refuses updates and deletes of a table without either.
        ALTER TABLE sqlstreams.exception_count_@id@ REPLICA IDENTITY FULL;
        CREATE FUNCTION sqlstreams.exception_count_@id@() RETURNS trigger
        LANGUAGE plpgsql
        SET search_path = pg_catalog, pg_temp
        AS $count$
        DECLARE
            groups   bigint[];
            statuses text[];
            deltas   bigint[];
        BEGIN
            -- What the statement changed, per group and status.
            IF TG_OP = 'INSERT' THEN
                SELECT array_agg(consumer_group_id), array_agg(status), array_agg(n) INTO groups, statuses, deltas
                FROM (SELECT consumer_group_id, status, count(*) AS n FROM added GROUP BY 1, 2) c;
            ELSIF TG_OP = 'DELETE' THEN
                SELECT array_agg(consumer_group_id), array_agg(status), array_agg(n) INTO groups, statuses, deltas
                FROM (SELECT consumer_group_id, status, -count(*) AS n FROM removed GROUP BY 1, 2) c;
            ELSE
                SELECT array_agg(consumer_group_id), array_agg(status), array_agg(n) INTO groups, statuses, deltas
                FROM (SELECT consumer_group_id, status, sum(d) AS n
                      FROM (SELECT consumer_group_id, status, 1 AS d FROM added
                            UNION ALL
                            SELECT consumer_group_id, status, -1 FROM removed) u
                      GROUP BY 1, 2 HAVING sum(d) <> 0) c;
            END IF;
            -- Added up in this backend and written once, just before the transaction commits
            -- (src/exception_queue/counts.rs).
            IF groups IS NOT NULL THEN
                PERFORM sqlstreams.exception_counts_changed(@id@, groups, statuses, deltas);
            END IF;
            RETURN NULL;
        END
        $count$;
        REVOKE ALL ON FUNCTION sqlstreams.exception_count_@id@() FROM PUBLIC;
        COMMENT ON FUNCTION sqlstreams.exception_count_@id@() IS
            'Keeps exception_count_@id@ in step with exception_queue_@id@ (statement triggers).';
        CREATE TRIGGER exception_count_added AFTER INSERT ON sqlstreams.exception_queue_@id@
            REFERENCING NEW TABLE AS added
            FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.exception_count_@id@();
        CREATE TRIGGER exception_count_changed AFTER UPDATE ON sqlstreams.exception_queue_@id@
            REFERENCING OLD TABLE AS removed NEW TABLE AS added
            FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.exception_count_@id@();
        CREATE TRIGGER exception_count_removed AFTER DELETE ON sqlstreams.exception_queue_@id@
            REFERENCING OLD TABLE AS removed
            FOR EACH STATEMENT EXECUTE FUNCTION sqlstreams.exception_count_@id@();
            -- Created by this script, they would belong to the extension; a stream's own do not.
            ALTER EXTENSION sqlstreams DROP TABLE sqlstreams.exception_count_@id@;
            ALTER EXTENSION sqlstreams DROP FUNCTION sqlstreams.exception_count_@id@();
            INSERT INTO sqlstreams.exception_count_@id@ (consumer_group_id, status, delta)
            SELECT consumer_group_id, status, count(*) FROM sqlstreams.exception_queue_@id@ GROUP BY 1, 2;
            -- After the counts of the rows there are: it would drop them.
            CREATE TRIGGER exception_count_restored BEFORE INSERT ON sqlstreams.exception_count_@id@
                FOR EACH ROW EXECUTE FUNCTION sqlstreams.exception_count_written();

            -- The archive of messages that exception rows refer to after their partition goes.
            CREATE TABLE sqlstreams.message_archive_@id@
                (LIKE sqlstreams.message_log_@id@ INCLUDING DEFAULTS INCLUDING CONSTRAINTS, PRIMARY KEY (id));
            ALTER EXTENSION sqlstreams DROP TABLE sqlstreams.message_archive_@id@;

        $family$, '@id@', s.id::text), '@lanes@', s.lanes::text);
        UPDATE sqlstreams.stream SET schema_version = '0.2.0' WHERE id = s.id;
    END LOOP;
END
$migrate$;

-- Every function runs with a pinned search_path, and the library's with generic plans (see the
-- install script). claim (without SET clauses in 0.1.0) applies both itself, before its first
-- statement.
ALTER FUNCTION sqlstreams.drop_stream(text) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.create_group(text, text, text, integer, text, interval, interval, double precision, integer, integer) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.drop_group(text, text) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.ack(text, text, uuid, bigint) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.ack_batch(text, text, uuid, bigint[]) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.fail(text, text, uuid, bigint, text, boolean, interval) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.delay(text, text, uuid, bigint, interval) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.extend_lease(text, text, uuid, interval) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.release(text, text, uuid, bigint[]) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.group_status(text, text) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.blocked_keys(text, text) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.dead_messages(text, text) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION sqlstreams.stream_head(bigint) SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan;

-- produce takes headers and deliver_after.
DROP FUNCTION sqlstreams.produce(text, jsonb, text, text, boolean, text);
CREATE FUNCTION sqlstreams.produce(
    stream text,
    payload jsonb,
    message_key text DEFAULT NULL,
    concurrency text DEFAULT NULL,
    compaction boolean DEFAULT false,
    idempotency_key text DEFAULT NULL,
    headers jsonb DEFAULT NULL,
    deliver_after interval DEFAULT NULL
) RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'produce_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- claim's columns are the contract's; the same claim with when each message was produced and
-- its headers has a function of its own.
CREATE FUNCTION sqlstreams.claim_with_metadata(
    stream text,
    group_name text,
    batch_size integer DEFAULT 100,
    lease interval DEFAULT '30 seconds',
    ack_lease_token uuid DEFAULT NULL,
    ack_message_ids bigint[] DEFAULT NULL
) RETURNS TABLE (
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
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'claim_with_metadata_sql_wrapper';

-- produce_batch takes idempotency keys, headers and deliver_after.
DROP FUNCTION sqlstreams.produce_batch(text, jsonb[], text[], text, boolean);
CREATE FUNCTION sqlstreams.produce_batch(
    stream text,
    payloads jsonb[],
    message_keys text[] DEFAULT NULL,
    concurrency text DEFAULT NULL,
    compaction boolean DEFAULT false,
    idempotency_keys text[] DEFAULT NULL,
    headers jsonb[] DEFAULT NULL,
    deliver_after interval DEFAULT NULL
) RETURNS SETOF bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'produce_batch_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- create_stream takes the lane count.
DROP FUNCTION sqlstreams.create_stream(text, bigint, interval);
CREATE FUNCTION sqlstreams.create_stream(
    name text,
    partition_size bigint DEFAULT 1000000,
    idempotency_ttl interval DEFAULT '1 day',
    lanes integer DEFAULT 16
) RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'create_stream_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- open_leases shows lanes.
DROP FUNCTION sqlstreams.open_leases(text, text);
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
STABLE PARALLEL SAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'open_leases_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- When a group's waiting work falls due (src/due.rs): what an idle consumer sleeps until.
CREATE FUNCTION sqlstreams.next_due(stream text, group_name text) RETURNS timestamptz
STABLE PARALLEL SAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'next_due_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- maintain() reports the expired lane holds it clears.
DROP FUNCTION sqlstreams.maintain();
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
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'maintain_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- maintain() for one stream (src/admin/maintain.rs), so a job can give each stream a transaction.
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
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'maintain_stream_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- DROP EXTENSION sqlstreams (or DROP SCHEMA sqlstreams CASCADE) while streams exist is refused
-- (src/drop_guard.rs): it would drop the catalog and leave the streams' tables behind.
CREATE FUNCTION sqlstreams.refuse_drop() RETURNS event_trigger
LANGUAGE c AS 'MODULE_PATHNAME', 'refuse_drop'
SET search_path = pg_catalog, pg_temp;
CREATE EVENT TRIGGER sqlstreams_refuse_drop ON ddl_command_start
    WHEN TAG IN ('DROP EXTENSION', 'DROP SCHEMA')
    EXECUTE FUNCTION sqlstreams.refuse_drop();

-- The channel consumers LISTEN on, so clients never spell it themselves.
CREATE FUNCTION sqlstreams.stream_channel(stream_id bigint) RETURNS text
STRICT IMMUTABLE PARALLEL SAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'stream_channel_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- Access (src/access.rs, src/lease.rs)
CREATE FUNCTION sqlstreams.grant_stream(stream text, role text, privilege text, group_name text DEFAULT NULL)
RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'grant_stream_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.revoke_stream(stream text, role text, privilege text, group_name text DEFAULT NULL)
RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'revoke_stream_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.visible(stream_id bigint, group_name text DEFAULT NULL)
RETURNS boolean
STABLE PARALLEL SAFE COST 1
LANGUAGE c AS 'MODULE_PATHNAME', 'visible_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.break_lease(stream text, group_name text, lease_token uuid)
RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'break_lease_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;


-- Operations (src/admin/streams.rs, src/admin/groups.rs, src/admin/dead_letters.rs, src/admin/seek.rs)
CREATE FUNCTION sqlstreams.peek(stream text, after_id bigint DEFAULT 0, max_messages integer DEFAULT 100)
RETURNS TABLE (message_id bigint, message_key text, produced_at timestamptz, payload jsonb)
STABLE PARALLEL SAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'peek_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.alter_stream(name text, dead_retention interval DEFAULT NULL, idempotency_ttl interval DEFAULT NULL,
    max_age interval DEFAULT NULL, max_bytes bigint DEFAULT NULL)
RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'alter_stream_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.alter_group(
    stream text,
    group_name text,
    concurrency_override text DEFAULT NULL,
    max_retries integer DEFAULT NULL,
    backoff_base interval DEFAULT NULL,
    backoff_cap interval DEFAULT NULL,
    backoff_exponent double precision DEFAULT NULL,
    max_delays integer DEFAULT NULL,
    max_reclaims integer DEFAULT NULL,
    on_dead text DEFAULT NULL,
    max_inflight integer DEFAULT NULL
) RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'alter_group_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.pause_group(stream text, group_name text) RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'pause_group_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.resume_group(stream text, group_name text) RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'resume_group_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.redrive(stream text, group_name text, message_ids bigint[] DEFAULT NULL) RETURNS bigint[]
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'redrive_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.skip(stream text, group_name text, message_id bigint) RETURNS boolean
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'skip_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.purge_dead(stream text, group_name text, older_than interval DEFAULT '0 seconds') RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'purge_dead_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

CREATE FUNCTION sqlstreams.seek(stream text, group_name text, to_id bigint DEFAULT NULL, to_time timestamptz DEFAULT NULL)
RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'seek_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan;

-- The views show only what the querying role may see; group_status reports the age of the
-- oldest unresolved message.
DROP VIEW sqlstreams.consumer_groups;
DROP VIEW sqlstreams.streams;
DROP FUNCTION sqlstreams.group_status(text, text);
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
-- Restricted: it adds the calling backend's count changes not written yet (src/inspect.rs).
-- No bitmap scans: they read the page of every dead row their index still points to (each
-- outcome rewrites its range's row), until vacuum; an index scan marks them dead in the index
-- the first time and then skips them.
STABLE PARALLEL RESTRICTED
LANGUAGE c AS 'MODULE_PATHNAME', 'group_status_wrapper'
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_bitmapscan = off;

-- Each view shows only what the querying role may see (sqlstreams.visible); as security
-- barriers, their filter runs before any condition of the query reaches a row.
CREATE VIEW sqlstreams.streams WITH (security_barrier) AS
SELECT s.id, s.name, s.partition_size, s.idempotency_ttl, s.created_at,
       sqlstreams.stream_head(s.id) AS head,
       s.schema_version,
       sqlstreams.stream_channel(s.id) AS channel,
       s.lanes, s.dead_retention, s.max_age, s.max_bytes
FROM sqlstreams.stream s
WHERE sqlstreams.visible(s.id);

CREATE VIEW sqlstreams.consumer_groups WITH (security_barrier) AS
SELECT g.id, g.stream_id, s.name AS stream, g.name, g.concurrency_override, g.max_retries,
       g.backoff_base, g.backoff_cap, g.backoff_exponent, g.max_delays, g.max_reclaims, g.created_at,
       p.claimed, p.committed, p.head, p.lag, p.open_ranges, p.ready, p.inflight, p.deferred, p.dead,
       p.superseded, g.paused, g.on_dead, p.oldest_unresolved_at,
       now() - p.oldest_unresolved_at AS oldest_unresolved_age, p.lost, p.held_back_bytes, g.max_inflight
FROM sqlstreams.consumer_group g
JOIN sqlstreams.stream s ON s.id = g.stream_id
-- The filter first, as the subquery's one-time filter (OFFSET 0 keeps it from being pulled up
-- after the call): group_status is called only for a group the caller may see, so none of its
-- errors (a name a restore left unreadable here, src/text.rs) shows a row the caller may not see.
CROSS JOIN LATERAL (SELECT * FROM sqlstreams.group_status(s.name, g.name)
                    WHERE sqlstreams.visible(s.id, g.name) OFFSET 0) p;

-- The sessions that hold a stream's fence back: transactions that are producing to it (or
-- prepared after producing) and have not ended. Claims wait for them; a long one shows here.
CREATE VIEW sqlstreams.fence_holders AS
-- One reading of the lock table for both of its uses below.
WITH locks AS MATERIALIZED (
    SELECT locktype, database, classid, objid, objsubid, transactionid, virtualtransaction, pid, mode
    FROM pg_catalog.pg_locks WHERE granted AND locktype IN ('advisory', 'transactionid'))
SELECT s.name AS stream, l.pid, l.virtualtransaction, a.backend_xid AS xid, a.xact_start,
       now() - a.xact_start AS age, a.state, a.usename, a.application_name,
       p.gid AS prepared_gid, p.prepared
FROM locks l
JOIN sqlstreams.stream s ON l.classid::int8 = (s.id >> 32) AND l.objid::int8 = (s.id & 4294967295)
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
-- A prepared transaction's locks have no backend (pid NULL). Which one it is: the transaction
-- whose id it holds its own lock on, under the same virtual transaction (that column's form
-- differs between major versions, so it is compared, never parsed).
LEFT JOIN LATERAL (
    SELECT p.gid, p.prepared
    FROM locks x JOIN pg_catalog.pg_prepared_xacts p ON p.transaction = x.transactionid
    WHERE l.pid IS NULL AND x.pid IS NULL AND x.locktype = 'transactionid' AND x.mode = 'ExclusiveLock'
      AND x.virtualtransaction = l.virtualtransaction
    LIMIT 1) p ON true
WHERE l.locktype = 'advisory' AND l.objsubid = 21328
  AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database());

----------------------------------------------------------------------------------------------
-- Privileges: nothing to PUBLIC; each role gets the functions of its part.
----------------------------------------------------------------------------------------------

REVOKE ALL ON sqlstreams.stream, sqlstreams.consumer_group, sqlstreams.stream_grant FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA sqlstreams FROM PUBLIC;
GRANT USAGE ON SCHEMA sqlstreams TO sqlstreams_admin, sqlstreams_producer, sqlstreams_consumer, pg_monitor;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA sqlstreams TO sqlstreams_admin;
REVOKE EXECUTE ON FUNCTION sqlstreams.create_stream_tables(bigint), sqlstreams.drop_stream_tables(bigint),
    sqlstreams.add_partitions(bigint, bigint, boolean), sqlstreams.drop_partitions(bigint, bigint),
    sqlstreams.exception_counts_changed(bigint, bigint[], text[], bigint[]), sqlstreams.catalog_changed(),
    sqlstreams.refuse_drop(), sqlstreams.exception_count_written(), sqlstreams.lock_log(bigint),
    sqlstreams.log_head(bigint)
    FROM sqlstreams_admin;
-- Each stream's trigger function (exception_count_<id>) is nobody's to call; the grant above
-- took them in.
DO $revoke$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
             WHERE p.pronamespace = 'sqlstreams'::regnamespace AND p.proname ~ '^exception_count_[0-9]+$' LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM sqlstreams_admin', f);
    END LOOP;
END
$revoke$;
GRANT SELECT ON sqlstreams.streams, sqlstreams.consumer_groups
    TO sqlstreams_admin, sqlstreams_producer, sqlstreams_consumer, pg_monitor;
GRANT SELECT ON sqlstreams.fence_holders TO sqlstreams_admin, pg_monitor;
GRANT EXECUTE ON FUNCTION
    sqlstreams.lane(text, bigint, integer),
    sqlstreams.lane_count_refused(integer),
    sqlstreams.visible(bigint, text),
    sqlstreams.stream_head(bigint),
    sqlstreams.stream_channel(bigint),
    sqlstreams.peek(text, bigint, integer)
    TO sqlstreams_producer, sqlstreams_consumer, pg_monitor;
GRANT EXECUTE ON FUNCTION
    sqlstreams.produce(text, jsonb, text, text, boolean, text, jsonb, interval),
    sqlstreams.produce_batch(text, jsonb[], text[], text, boolean, text[], jsonb[], interval)
    TO sqlstreams_producer;
GRANT EXECUTE ON FUNCTION
    sqlstreams.create_group(text, text, text, integer, text, interval, interval, double precision, integer, integer),
    sqlstreams.claim(text, text, integer, interval, uuid, bigint[]),
    sqlstreams.claim_with_metadata(text, text, integer, interval, uuid, bigint[]),
    sqlstreams.ack(text, text, uuid, bigint),
    sqlstreams.ack_batch(text, text, uuid, bigint[]),
    sqlstreams.fail(text, text, uuid, bigint, text, boolean, interval),
    sqlstreams.delay(text, text, uuid, bigint, interval),
    sqlstreams.extend_lease(text, text, uuid, interval),
    sqlstreams.release(text, text, uuid, bigint[])
    TO sqlstreams_consumer;
GRANT EXECUTE ON FUNCTION
    sqlstreams.group_status(text, text),
    sqlstreams.blocked_keys(text, text),
    sqlstreams.dead_messages(text, text),
    sqlstreams.open_leases(text, text),
    sqlstreams.next_due(text, text)
    TO sqlstreams_consumer, pg_monitor;
-- The consumer_groups view calls group_status, so a producer may call it too (and sees no
-- group: its own check refuses a role without a consume grant on the group, with 42501).
GRANT EXECUTE ON FUNCTION sqlstreams.group_status(text, text) TO sqlstreams_producer;


COMMENT ON VIEW sqlstreams.streams IS
    'Every stream with its id (its tables are named by it), head (highest message id handed out), '
    'the version its tables were built by, the channel its consumers LISTEN on, and its lanes.';
COMMENT ON FUNCTION sqlstreams.lane(text, bigint, integer) IS
    'The lane of a message: by its key''s hash, or round in blocks of 64 ids for messages without a key.';
COMMENT ON FUNCTION sqlstreams.next_due(text, text) IS
    'When the group''s earliest retry, delay, expiring lease or lane hold falls due: what an idle consumer sleeps until; NULL when nothing waits for a time.';
COMMENT ON FUNCTION sqlstreams.exception_count_written() IS
    'Trigger: keeps the exception count rows the library writes, drops any other (a data-only restore''s).';
COMMENT ON FUNCTION sqlstreams.lock_log(bigint) IS
    'Internal: locks a stream''s log ACCESS EXCLUSIVE if it can within 20 ms; whether it did.';
COMMENT ON FUNCTION sqlstreams.log_head(bigint) IS
    'Internal: the last id handed out on a stream, read under its sequence''s buffer lock.';
COMMENT ON FUNCTION sqlstreams.refuse_drop() IS
    'Event trigger: refuses DROP EXTENSION sqlstreams and DROP SCHEMA sqlstreams while streams exist.';
COMMENT ON FUNCTION sqlstreams.lane_count_refused(integer) IS
    'Raises 22023 for a lane count no stream can have; sqlstreams.lane calls it.';
COMMENT ON FUNCTION sqlstreams.create_stream_tables(bigint) IS
    'Internal: creates the table family of a stream (called by create_stream).';
COMMENT ON FUNCTION sqlstreams.drop_stream_tables(bigint) IS
    'Internal: drops the table family of a stream (called by drop_stream).';
COMMENT ON FUNCTION sqlstreams.add_partitions(bigint, bigint, boolean) IS
    'Internal: creates message_log partitions of a stream until they cover upto, and returns the new partitions_through.';
COMMENT ON FUNCTION sqlstreams.create_stream(text, bigint, interval, integer) IS
    'Creates a stream and its table family and returns its id; an existing name returns its id. '
    'lanes: how many lanes its messages are spread over (fixed). Takes: the stream catalog row, '
    'DDL locks on the new tables.';
COMMENT ON FUNCTION sqlstreams.produce(text, jsonb, text, text, boolean, text, jsonb, interval) IS
    'Appends a message in the caller''s transaction and returns its id (NULL for a repeated idempotency_key). '
    'headers: a JSON object handed out with it; deliver_after: not handed out before that long after the '
    'transaction started. Takes: the stream''s producer lock (shared) and a transaction id before the '
    'message id; the key''s compaction head row until commit.';
COMMENT ON FUNCTION sqlstreams.claim_with_metadata(text, text, integer, interval, uuid, bigint[]) IS
    'claim, with two more columns: produced_at (the producer''s transaction start) and headers.';
COMMENT ON FUNCTION sqlstreams.claim(text, text, integer, interval, uuid, bigint[]) IS
    'Returns the work a consumer may run now under one lease: due exception rows and a claimed range '
    'from each lane it takes, in id order; run_after chains same-key rows. Takes: free lanes of the '
    'group (never waiting for one) until commit. Call it in its own READ COMMITTED transaction; an idle call '
    'writes nothing. ack_lease_token/ack_message_ids first record successes of an earlier claim (one '
    'round trip, one commit).';
COMMENT ON FUNCTION sqlstreams.open_leases(text, text) IS 'Range, exception-row and lane leases a group holds now.';
COMMENT ON FUNCTION sqlstreams.stream_channel(bigint) IS 'The channel a stream''s consumers LISTEN on; produce NOTIFYs it at commit.';
COMMENT ON FUNCTION sqlstreams.maintain() IS
    'Housekeeping for every stream: partitions ahead of the head, expired idempotency keys, groups'' '
    'claimed and committed cursors, expired lane holds. Idempotent; run it from cron at any frequency.';
COMMENT ON FUNCTION sqlstreams.exception_counts_changed(bigint, bigint[], text[], bigint[]) IS
    'Internal: the exception counts'' triggers pass each statement''s changes; written at commit.';
COMMENT ON FUNCTION sqlstreams.catalog_changed() IS
    'Internal: the catalog tables'' triggers; they tell every backend to forget what it remembers of them.';
COMMENT ON FUNCTION sqlstreams.maintain_stream(text) IS
    'maintain() for one stream, in the caller''s transaction.';
COMMENT ON TABLE sqlstreams.stream_grant IS
    'Who may produce to a stream or consume as its groups; managed with grant_stream and revoke_stream.';
COMMENT ON FUNCTION sqlstreams.grant_stream(text, text, text, text) IS
    'Lets a role produce to a stream (''produce'') or consume as one of its groups (''consume'', every group '
    'when group_name is NULL); the role also needs sqlstreams_producer or sqlstreams_consumer. Admins only.';
COMMENT ON FUNCTION sqlstreams.revoke_stream(text, text, text, text) IS
    'Takes back one grant_stream grant; false when there was none. Admins only.';
COMMENT ON FUNCTION sqlstreams.visible(bigint, text) IS
    'Whether the calling role may see a stream (any grant on it) or one of its groups (a consume grant): '
    'the filter of the sqlstreams.streams and sqlstreams.consumer_groups views.';
COMMENT ON FUNCTION sqlstreams.break_lease(text, text, uuid) IS
    'Ends every lease under a token now (range, exception rows, lane holds), so the next claim takes the '
    'work over; false when the token holds nothing. Admins only.';
COMMENT ON VIEW sqlstreams.consumer_groups IS
    'Every consumer group with its settings, cursor (claimed, committed), lag and exception-queue counts.';
COMMENT ON FUNCTION sqlstreams.drop_partitions(bigint, bigint) IS
    'Internal: drops message_log partitions no group needs any more (retention).';
COMMENT ON FUNCTION sqlstreams.group_status(text, text) IS
    'One group''s claimed and committed cursor, head, lag, open ranges and exception-queue counts.';
COMMENT ON FUNCTION sqlstreams.alter_stream(text, interval, interval, interval, bigint) IS
    'Changes a stream''s dead_retention, idempotency_ttl or bounds (max_age, max_bytes; 0 removes a bound); '
    'NULL keeps the current value. Admins only.';
COMMENT ON FUNCTION sqlstreams.alter_group(text, text, text, integer, interval, interval, double precision, integer, integer, text, integer) IS
    'Changes only the settings given (NULL keeps the current value; concurrency_override => ''none'' removes it), '
    'including on_dead (''release'' or ''hold'') and max_inflight (0 removes the cap). Admins only.';
COMMENT ON FUNCTION sqlstreams.pause_group(text, text) IS
    'Pauses a group: its claims hand out nothing until resume_group; outcomes still count. Admins only.';
COMMENT ON FUNCTION sqlstreams.resume_group(text, text) IS 'Resumes a paused group. Admins only.';
COMMENT ON FUNCTION sqlstreams.redrive(text, text, bigint[]) IS
    'Gives dead messages (all, or message_ids) another run with a fresh retry budget; returns the ids. Admins only.';
COMMENT ON FUNCTION sqlstreams.skip(text, text, bigint) IS
    'Resolves a dead message for good without running it (releases a held ordered key). Admins only.';
COMMENT ON FUNCTION sqlstreams.purge_dead(text, text, interval) IS
    'Removes dead messages that died at least older_than ago; returns how many. Admins only.';
COMMENT ON FUNCTION sqlstreams.seek(text, text, bigint, timestamptz) IS
    'Moves a group to after to_id (or the last message produced before to_time): back replays, forward skips; '
    'forgets the group''s open ranges and exception rows. Returns the new position. Admins only.';
COMMENT ON VIEW sqlstreams.fence_holders IS
    'Transactions producing to a stream that have not ended (claims wait for them), with their age.';
COMMENT ON FUNCTION sqlstreams.peek(text, bigint, integer) IS
    'The messages of a stream after after_id, oldest first, without claiming anything (an operator''s tail). '
    'Needs a consume grant on one of the stream''s groups, or pg_monitor.';
COMMENT ON FUNCTION sqlstreams.produce_batch(text, jsonb[], text[], text, boolean, text[], jsonb[], interval) IS
    'Appends many messages in one call (the fast path); returns their ids in payload order (NULL for a '
    'message whose idempotency key was already used). headers: one object (or NULL) per message; '
    'deliver_after: for every message.';
