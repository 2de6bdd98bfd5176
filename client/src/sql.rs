//! The SQL text of every call the client makes: one place, and nothing but the extension's
//! functions (the client never touches the extension's tables). Durations travel as seconds.

pub const CREATE_STREAM: &str =
    "SELECT sqlstreams.create_stream($1, $2, idempotency_ttl => $3::float8 * interval '1 second')";

pub const STREAM_ID: &str = "SELECT id FROM sqlstreams.streams WHERE name = $1";

/// The channel the stream's consumers LISTEN on (the extension NOTIFYs it on commit).
pub const STREAM_CHANNEL: &str = "SELECT channel FROM sqlstreams.streams WHERE name = $1";

pub const CREATE_GROUP: &str = "SELECT sqlstreams.create_group($1, $2, $3, $4::int4, $5,
        backoff_base => $6::float8 * interval '1 second',
        backoff_cap => $7::float8 * interval '1 second',
        backoff_exponent => $8,
        max_delays => $9::int4,
        max_reclaims => $10::int4)";

/// A group's stored settings (durations in microseconds), for `register` to compare.
pub const GROUP_SETTINGS: &str = "SELECT concurrency_override, max_retries,
        (extract(epoch FROM backoff_base) * 1e6)::int8, (extract(epoch FROM backoff_cap) * 1e6)::int8,
        backoff_exponent, max_delays, max_reclaims
        FROM sqlstreams.consumer_groups WHERE stream = $1 AND name = $2";

pub const PRODUCE: &str = "SELECT sqlstreams.produce($1, $2::text::jsonb, $3, $4, $5, $6,
        headers => $7, deliver_after => $8::float8 * interval '1 second')";

/// `$6`, the batch's headers, go with every message of it. The ids come back as one array: one
/// row to send and read, not one per message.
pub const PRODUCE_BATCH: &str = "SELECT coalesce(array_agg(p.id ORDER BY p.n), '{}')
        FROM sqlstreams.produce_batch($1, $2::text[]::jsonb[], $3, $4, $5,
            headers => CASE WHEN $6::jsonb IS NOT NULL THEN array_fill($6::jsonb, ARRAY[cardinality($2)]) END,
            deliver_after => $7::float8 * interval '1 second') WITH ORDINALITY AS p(id, n)";

/// Claims, first acking `$6` under lease token `$5` when given (one round trip, one commit).
pub const CLAIM: &str = "SELECT message_id, message_key, concurrency, attempt, payload::text, lease_token, run_after,
        produced_at, headers
        FROM sqlstreams.claim_with_metadata($1, $2, $3, $4::float8 * interval '1 second', $5, $6)";

pub const ACK: &str = "SELECT sqlstreams.ack($1, $2, $3, $4)";

pub const ACK_BATCH: &str = "SELECT sqlstreams.ack_batch($1, $2, $3, $4)";

pub const FAIL: &str = "SELECT sqlstreams.fail($1, $2, $3, $4, $5, $6, $7::float8 * interval '1 second')";

pub const DELAY: &str = "SELECT sqlstreams.delay($1, $2, $3, $4, $5::float8 * interval '1 second')";

pub const RELEASE: &str = "SELECT sqlstreams.release($1, $2, $3, $4)";

/// The group's lag and the age of its oldest unresolved message, in seconds.
pub const LAG: &str = "SELECT lag, coalesce(extract(epoch FROM now() - oldest_unresolved_at), 0)::float8
        FROM sqlstreams.group_status($1, $2)";

/// Seconds until the group's earliest retry, delay, lease or lane hold falls due (NULL: none),
/// by the server's clock.
pub const NEXT_DUE_IN: &str = "SELECT extract(epoch FROM sqlstreams.next_due($1, $2) - clock_timestamp())::float8";

pub const EXTEND_LEASE: &str = "SELECT sqlstreams.extend_lease($1, $2, $3, $4::float8 * interval '1 second')";
