-- The table family of one stream. create_stream() runs this with @id@ replaced by the stream's
-- numeric id (never by its name: names are data). Partitions of message_log_@id@ are created by
-- the code in src/partition.rs.

-- Message ids. CACHE 1 is load-bearing: the claim fence (src/fence.rs) reads last_value as the
-- highest id handed out, which per-backend caching would break.
CREATE SEQUENCE sqlstreams.message_log_@id@_seq AS bigint MINVALUE 1 CACHE 1;

-- The stream itself: append-only, range-partitioned by id so consumed blocks can be dropped.
CREATE TABLE sqlstreams.message_log_@id@ (
    id          bigint      NOT NULL,
    message_key text,
    -- The producer's requested policy; a group's concurrency_override wins over it.
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
--   fence_xid has ended" (see src/fence.rs).
CREATE TABLE sqlstreams.cursor_@id@ (
    consumer_group_id bigint PRIMARY KEY,
    claimed           bigint NOT NULL,
    committed         bigint NOT NULL,
    fence_head        bigint,
    fence_xid         bigint,
    CHECK (committed <= claimed)
);

-- Open range claims. A range (first_id .. last_id) is handed to one consumer under a lease;
-- pending lists its messages without an outcome yet (with their keys, for the ordered check of
-- other claims). The row is deleted when pending becomes empty.
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

-- Every (group, message) that left the happy path. See SEMANTICS.md section 1 for the statuses.
-- A deferred or blocked row is "parked": can_run_after is the latest time its blocker could
-- clear on its own, and resolving the blocker wakes it earlier (src/exception_queue.rs).
CREATE TABLE sqlstreams.exception_queue_@id@ (
    consumer_group_id bigint      NOT NULL,
    message_id        bigint      NOT NULL,
    message_key       text,
    concurrency       text        NOT NULL CHECK (concurrency IN ('parallel', 'exclusive', 'ordered')),
    compaction        boolean     NOT NULL DEFAULT false,
    status            text        NOT NULL CHECK (status IN ('ready', 'inflight', 'deferred', 'dead', 'superseded')),
    attempts          int         NOT NULL DEFAULT 0,
    delays            int         NOT NULL DEFAULT 0,
    can_run_after     timestamptz NOT NULL,
    parked            boolean     NOT NULL DEFAULT false,
    -- A message of a quarantined range: handed out alone until it resolves, so only its own
    -- failures and expiries count against it.
    isolated          boolean     NOT NULL DEFAULT false,
    last_error        text,
    lease_token       uuid,
    lease_expires_at  timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
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
-- Unresolved messages of quarantined ranges (usually none).
CREATE INDEX exception_queue_@id@_isolated_idx
    ON sqlstreams.exception_queue_@id@ (consumer_group_id, message_id)
    WHERE isolated AND status IN ('ready', 'inflight', 'deferred');
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
