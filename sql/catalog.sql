-- sqlstreams catalog: what streams and consumer groups exist, and their settings.
--
-- Each stream also owns a family of tables named by its numeric id (message_log_<id>,
-- exception_queue_<id>, ...); create_stream() creates them from sql/stream_family.sql.
-- Those tables are not extension members, so pg_dump keeps them; the two catalog tables
-- below are members and are registered with pg_extension_config_dump() for the same reason.

-- Stream tables are not extension members, so DROP EXTENSION leaves them behind (pg_dump keeps
-- them for the same reason). Refuse to reuse stream ids over such leftovers.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_class
               WHERE relnamespace = 'sqlstreams'::regnamespace AND relname ~ '^message_log_[0-9]+$') THEN
        RAISE EXCEPTION 'schema sqlstreams still holds the streams of an earlier installation'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Remove them with DROP SCHEMA sqlstreams CASCADE (this deletes those streams), then CREATE EXTENSION sqlstreams.';
    END IF;
END
$$;

CREATE TABLE sqlstreams.stream (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name               text        NOT NULL UNIQUE,
    -- message_log_<id> is range-partitioned by message id in blocks of this many ids.
    partition_size     bigint      NOT NULL CHECK (partition_size > 0),
    -- Every id below this value has a partition; produce() extends it ahead of the head.
    partitions_through bigint      NOT NULL,
    -- How long an idempotency key suppresses a repeated produce.
    idempotency_ttl    interval    NOT NULL DEFAULT '1 day',
    created_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE sqlstreams.consumer_group (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream_id            bigint      NOT NULL REFERENCES sqlstreams.stream (id) ON DELETE CASCADE,
    name                 text        NOT NULL,
    -- NULL: each message's requested policy applies (keyed messages default to parallel).
    concurrency_override text        CHECK (concurrency_override IN ('parallel', 'exclusive', 'ordered')),
    -- Retries after the first failed run; max_retries = 3 means four runs in all.
    max_retries          int         NOT NULL CHECK (max_retries >= 0),
    -- Retry backoff: least(backoff_cap, backoff_base * backoff_exponent ^ (attempts - 1)).
    backoff_base         interval    NOT NULL,
    backoff_cap          interval    NOT NULL,
    backoff_exponent     float8      NOT NULL CHECK (backoff_exponent >= 1),
    -- Requested delays allowed per message before it is dead-lettered; NULL: unbounded.
    max_delays           int         CHECK (max_delays >= 0),
    -- Times an expired range lease is handed out again before its messages are quarantined
    -- into the exception queue one by one.
    max_reclaims         int         NOT NULL CHECK (max_reclaims >= 0),
    created_at           timestamptz NOT NULL DEFAULT now(),
    UNIQUE (stream_id, name)
);

SELECT pg_catalog.pg_extension_config_dump('sqlstreams.stream', '');
SELECT pg_catalog.pg_extension_config_dump('sqlstreams.consumer_group', '');
SELECT pg_catalog.pg_extension_config_dump('sqlstreams.stream_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('sqlstreams.consumer_group_id_seq', '');
