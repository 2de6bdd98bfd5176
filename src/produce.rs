//! Producing: `produce` and `produce_batch`, in the caller's transaction (the outbox pattern).
//!
//! Order matters for the claim fence (src/fence.rs): the transaction id is taken first, then the
//! message ids. Everything is validated before the first write.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::access::{self, Right};
use crate::append;
use crate::concurrency::{Concurrency, ProduceRequest};
use crate::error::{Result, SqlResult, StreamError};
use crate::locks;
use crate::names::validate_name;
use crate::notify;
use crate::partition::{self, Need};
use crate::payload::{RawJsonb, RawJsonbArray};
use crate::srf;
use crate::statement::{Columns, Statement};
use crate::stream::{self, StreamRef};
use crate::text::{RawText, Text};
use pgrx::pg_sys::panic::ErrorReport;

const NEXT_ID: Statement =
    Statement { name: "produce_next_id", sql: "SELECT nextval('sqlstreams.message_log_@id@_seq') AS id", params: &[] };

const NEXT_IDS: Statement = Statement {
    name: "produce_next_ids",
    sql: "SELECT array(SELECT nextval('sqlstreams.message_log_@id@_seq') FROM generate_series(1, $1)) AS ids",
    params: &[INT4OID],
};

/// The `INSERT`s write a log a DBA changed (src/append.rs writes the others). `deliver_at`
/// counts from the producer's transaction start, like `produced_at`.
const INSERT_ONE: Statement = Statement {
    name: "produce_insert_one",
    sql: "INSERT INTO sqlstreams.message_log_@id@
              (id, message_key, concurrency, compaction, payload, lane, headers, deliver_at)
          VALUES ($1, $2, $3, $4, $5, sqlstreams.lane($2, $1, $6), $7, now() + $8)",
    params: &[INT8OID, TEXTOID, TEXTOID, BOOLOID, JSONBOID, INT4OID, JSONBOID, INTERVALOID],
};

/// Every message of the batch, or only the ids in `$7` (those whose idempotency key was new).
const INSERT_MANY: Statement = Statement {
    name: "produce_insert_many",
    sql: "INSERT INTO sqlstreams.message_log_@id@
              (id, message_key, concurrency, compaction, payload, lane, headers, deliver_at)
          SELECT u.id, u.message_key, $3, $4, u.payload, sqlstreams.lane(u.message_key, u.id, $6),
                 u.headers, now() + $9
          FROM unnest($1::bigint[], $2::text[], $5::jsonb[], $8::jsonb[]) AS u(id, message_key, payload, headers)
          WHERE $7::bigint[] IS NULL OR u.id = ANY($7)",
    params: &[
        INT8ARRAYOID,
        TEXTARRAYOID,
        TEXTOID,
        BOOLOID,
        JSONBARRAYOID,
        INT4OID,
        INT8ARRAYOID,
        JSONBARRAYOID,
        INTERVALOID,
    ],
};

/// `IDEMPOTENCY` for a batch: returns the ids whose key was new (or had expired).
const IDEMPOTENCY_MANY: Statement = Statement {
    name: "produce_idempotency_many",
    sql: "INSERT INTO sqlstreams.idempotency_key_@id@ AS k (idempotency_key, message_id, expires_at)
          SELECT u.idempotency_key, u.id, now() + s.idempotency_ttl
          FROM unnest($1::text[], $2::bigint[]) AS u(idempotency_key, id), sqlstreams.stream s
          WHERE s.id = $3
          ON CONFLICT (idempotency_key) DO UPDATE
              SET message_id = EXCLUDED.message_id, expires_at = EXCLUDED.expires_at
              WHERE k.expires_at <= now()
          RETURNING k.message_id",
    params: &[TEXTARRAYOID, INT8ARRAYOID, INT8OID],
};

const IDEMPOTENCY: Statement = Statement {
    name: "produce_idempotency",
    sql: "INSERT INTO sqlstreams.idempotency_key_@id@ AS k (idempotency_key, message_id, expires_at)
          SELECT $1, $2, now() + s.idempotency_ttl FROM sqlstreams.stream s WHERE s.id = $3
          ON CONFLICT (idempotency_key) DO UPDATE
              SET message_id = EXCLUDED.message_id, expires_at = EXCLUDED.expires_at
              WHERE k.expires_at <= now()
          RETURNING k.message_id",
    params: &[TEXTOID, INT8OID, INT8OID],
};

// Same-key compacted produces serialize on this row until commit; greatest() keeps the head
// right when they commit out of id order.
const COMPACTION_HEADS: Statement = Statement {
    name: "produce_compaction_heads",
    sql: "INSERT INTO sqlstreams.compaction_head_@id@ AS h (message_key, message_id)
          SELECT DISTINCT ON (u.message_key) u.message_key, u.id
          FROM unnest($1::text[], $2::bigint[]) AS u(message_key, id)
          ORDER BY u.message_key, u.id DESC
          ON CONFLICT (message_key) DO UPDATE SET message_id = greatest(h.message_id, EXCLUDED.message_id)",
    params: &[TEXTARRAYOID, INT8ARRAYOID],
};

const BATCH_SHAPE: Statement = Statement {
    name: "produce_batch_shape",
    sql: "SELECT coalesce(cardinality($1), 0) AS count,
                 CASE WHEN coalesce(array_ndims($1), 1) = 1 THEN array_position($1, NULL) END AS first_null,
                 coalesce(array_ndims($1), 1) AS dimensions",
    params: &[JSONBARRAYOID],
};

/// Headers must be a JSON object (NULL: none).
const HEADERS_KIND: Statement =
    Statement { name: "produce_headers_kind", sql: "SELECT jsonb_typeof($1) AS kind", params: &[JSONBOID] };

/// A batch's headers: one per payload, each an object or NULL.
const BATCH_HEADERS: Statement = Statement {
    name: "produce_batch_headers",
    sql: "SELECT coalesce(cardinality($1), 0) AS count, coalesce(array_ndims($1), 1) AS dimensions,
                 (SELECT min(u.n) FROM unnest($1) WITH ORDINALITY AS u(h, n)
                  WHERE jsonb_typeof(u.h) <> 'object')::int4 AS first_bad",
    params: &[JSONBARRAYOID],
};

const HEADERS_HINT: &str = "Pass headers as a JSON object, such as '{\"traceparent\": \"00-...\"}', or NULL for none.";

fn check_headers(client: &SpiClient<'_>, headers: Option<RawJsonb>) -> Result<()> {
    let Some(headers) = headers else { return Ok(()) };
    let kind: String = HEADERS_KIND.run(client, 0, &[headers.into()])?.first().required("kind")?;
    if kind != "object" {
        return Err(StreamError::invalid(format!("headers must be a JSON object, not {kind}"), HEADERS_HINT));
    }
    Ok(())
}

fn check_batch_headers(client: &SpiClient<'_>, headers: Option<RawJsonbArray>, count: i32) -> Result<()> {
    let Some(headers) = headers else { return Ok(()) };
    let shape = BATCH_HEADERS.run(client, 0, &[headers.into()])?.first();
    let given: i32 = shape.required("count")?;
    if shape.value::<i32>("dimensions")? != Some(1) {
        return Err(StreamError::invalid(
            "headers must be a one-dimensional array",
            "Pass one headers object per payload, such as ARRAY['{\"h\": 1}', NULL]::jsonb[].",
        ));
    }
    if given != count {
        return Err(StreamError::invalid(
            format!("headers has {given} elements but payloads has {count}"),
            "Pass one headers object per payload (NULL for a message without headers), or no headers at all.",
        ));
    }
    if let Some(position) = shape.value::<i32>("first_bad")? {
        return Err(StreamError::invalid(
            format!("headers {position} of the batch is not a JSON object"),
            HEADERS_HINT,
        ));
    }
    Ok(())
}

/// The longest `deliver_after`: ten years as Postgres counts an interval (a month is 30 days),
/// so that `'10 years 50 days'` is longer, as Postgres compares them.
const MAX_DELIVER_AFTER_MICROS: i128 = 10 * 12 * 30 * 86_400 * 1_000_000;

/// `deliver_after`, checked: not negative, at most ten years, and not with compaction (a
/// newer state that is not due yet would supersede the state that is); zero (or NULL)
/// delivers at once.
pub fn check_deliver_after(deliver_after: Option<Interval>, compaction: bool) -> Result<Option<Interval>> {
    let hint = "Pass how long to hold the message back, such as '5 minutes', or NULL to deliver it at once.";
    match deliver_after {
        Some(d) if d.as_micros() < 0 => Err(StreamError::invalid(format!("deliver_after '{d}' is negative"), hint)),
        Some(d) if d.as_micros() > MAX_DELIVER_AFTER_MICROS => {
            Err(StreamError::invalid(format!("deliver_after '{d}' is longer than 10 years"), hint))
        }
        Some(d) if d.as_micros() == 0 => Ok(None),
        Some(_) if compaction => Err(StreamError::invalid(
            "a compacted message cannot be delayed",
            "Compaction delivers a key's latest state, and a state that is not due yet would supersede the one that \
             is: produce it with compaction => false, or without deliver_after.",
        )),
        other => Ok(other),
    }
}

/// What a message carries besides its payload and key: headers, and when it may be delivered.
#[derive(Clone, Copy, Default)]
pub struct Extras {
    pub headers: Option<RawJsonb>,
    pub deliver_after: Option<Interval>,
}

/// `Extras` of a batch: one headers object per message; one `deliver_after` for all.
#[derive(Clone, Copy, Default)]
pub struct BatchExtras {
    pub headers: Option<RawJsonbArray>,
    pub deliver_after: Option<Interval>,
}

/// Takes this transaction's id, then registers it as a producer of the stream, both before any
/// message id (the fence's rules, src/fence.rs). In this order a producer lock's holder always
/// has its transaction id, so a claim that reads a holder's as none knows the holder is ending
/// or being prepared (src/locks.rs `producer_xids`).
fn become_producer(stream: &StreamRef) {
    // SAFETY: assigns a top-level transaction id (or returns the one already assigned).
    unsafe {
        pg_sys::GetTopTransactionId();
    }
    locks::register_producer(stream.id);
}

fn next_ids(client: &SpiClient<'_>, stream: &StreamRef, count: i32) -> Result<Vec<i64>> {
    become_producer(stream);
    if count == 1 {
        let id: i64 = NEXT_ID.run(client, stream.id, &[])?.first().required("id")?;
        return Ok(vec![id]);
    }
    NEXT_IDS.run(client, stream.id, &[count.into()])?.first().required("ids")
}

fn finish(
    client: &mut SpiClient<'_>,
    stream: &StreamRef,
    ids: &[i64],
    keys: &[Option<&str>],
    compaction: bool,
) -> Result<()> {
    if compaction {
        let keys: Vec<Option<&str>> = keys.to_vec();
        COMPACTION_HEADS.run(client, stream.id, &[keys.into(), ids.to_vec().into()])?;
    }
    notify::signal(stream.id);
    Ok(())
}

/// Produces one message; `None` when `idempotency_key` was already used within its TTL.
pub fn produce_one(
    stream_name: &str,
    payload: RawJsonb,
    request: &ProduceRequest<'_>,
    idempotency_key: Option<&str>,
    extras: Extras,
) -> Result<Option<i64>> {
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            let stream = stream::lookup(client, stream_name)?;
            caller.require(client, stream.id, stream_name, Right::Produce)?;
            check_headers(client, extras.headers)?;
            let id = next_ids(client, &stream, 1)?[0];
            if let Some(key) = idempotency_key {
                let claimed = IDEMPOTENCY.run(client, stream.id, &[key.into(), id.into(), stream.id.into()])?;
                if claimed.is_empty() {
                    return Ok(None);
                }
            }
            partition::ensure(client, &stream, id, Need::Now)?;
            let target = partition::lock_for_insert(client, &stream, id, id)?;
            let message = append::Message {
                id,
                key: request.message_key,
                payload: payload.into_datum().expect("a payload is a datum"),
                headers: extras.headers.and_then(IntoDatum::into_datum),
            };
            let shared = append::Shared {
                concurrency: request.concurrency,
                compaction: request.compaction,
                deliver_after: extras.deliver_after,
            };
            if !append::append(&stream, &target, &[message], &shared) {
                INSERT_ONE.run(
                    client,
                    stream.id,
                    &[
                        id.into(),
                        request.message_key.into(),
                        request.concurrency.map(Concurrency::as_str).into(),
                        request.compaction.into(),
                        payload.into(),
                        stream.lanes.into(),
                        extras.headers.into(),
                        extras.deliver_after.into(),
                    ],
                )?;
            }
            finish(client, &stream, &[id], &[request.message_key], request.compaction)?;
            Ok(Some(id))
        })
    })
}

/// Produces many messages in one statement; ids follow the order of `payloads`. A message whose
/// idempotency key was already used (within the stream's TTL, or earlier in the batch)
/// produces nothing and its id is `None`.
pub fn produce_many(
    stream_name: &str,
    payloads: RawJsonbArray,
    keys: Option<Vec<Option<&str>>>,
    concurrency: Option<&str>,
    compaction: bool,
    idempotency_keys: Option<Vec<Option<&str>>>,
    extras: BatchExtras,
) -> Result<Vec<Option<i64>>> {
    let BatchExtras { headers, deliver_after } = extras;
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            let stream = stream::lookup(client, stream_name)?;
            caller.require(client, stream.id, stream_name, Right::Produce)?;
            let shape = BATCH_SHAPE.run(client, 0, &[payloads.into()])?.first();
            let count: i32 = shape.required("count")?;
            if shape.value::<i32>("dimensions")? != Some(1) {
                return Err(StreamError::invalid(
                    "payloads must be a one-dimensional array",
                    "Pass one jsonb per message, such as ARRAY['{\"a\":1}', '{\"a\":2}']::jsonb[].",
                ));
            }
            if let Some(position) = shape.value::<i32>("first_null")? {
                return Err(StreamError::invalid(
                    format!("payload {position} of the batch is NULL"),
                    "Every message needs a payload; use 'null'::jsonb or '{}' for an empty one.",
                ));
            }
            let keys = keys.unwrap_or_else(|| vec![None; count as usize]);
            if keys.len() != count as usize {
                return Err(StreamError::invalid(
                    format!("message_keys has {} elements but payloads has {count}", keys.len()),
                    "Pass one key per payload (NULL for a message without a key), or no message_keys at all.",
                ));
            }
            let policy = concurrency.map(|c| Concurrency::parse("concurrency", c)).transpose()?;
            for key in &keys {
                ProduceRequest::validate(*key, concurrency, compaction)?;
            }
            if let Some(idempotency) = &idempotency_keys {
                check_idempotency_keys(idempotency, count as usize)?;
            }
            check_batch_headers(client, headers, count)?;
            if count == 0 {
                return Ok(vec![]);
            }
            let ids = next_ids(client, &stream, count)?;
            // With idempotency keys: the first message of each key that is new produces.
            let produced: Option<Vec<i64>> = match &idempotency_keys {
                None => None,
                Some(idempotency) => {
                    let mut seen = std::collections::HashSet::new();
                    let (fresh_keys, fresh_ids): (Vec<&str>, Vec<i64>) = idempotency
                        .iter()
                        .zip(&ids)
                        .filter_map(|(key, id)| key.filter(|k| seen.insert(*k)).map(|k| (k, *id)))
                        .unzip();
                    let won: std::collections::HashSet<i64> = IDEMPOTENCY_MANY
                        .run(client, stream.id, &[fresh_keys.into(), fresh_ids.into(), stream.id.into()])?
                        .map(|row| row.required::<i64>("message_id"))
                        .collect::<Result<_>>()?;
                    Some(
                        idempotency
                            .iter()
                            .zip(&ids)
                            .filter(|(key, id)| key.is_none() || won.contains(id))
                            .map(|(_, id)| *id)
                            .collect(),
                    )
                }
            };
            let payload_datums = payloads.elements();
            let header_datums = headers.map(RawJsonbArray::elements);
            let messages: Vec<append::Message<'_>> = ids
                .iter()
                .enumerate()
                .filter(|(_, id)| produced.as_ref().is_none_or(|p| p.contains(id)))
                .map(|(i, &id)| append::Message {
                    id,
                    key: keys[i],
                    payload: payload_datums[i].expect("no payload is NULL (checked above)"),
                    headers: header_datums.as_ref().and_then(|h| h[i]),
                })
                .collect();
            let (Some(first), Some(last)) = (messages.first(), messages.last()) else {
                return Ok(vec![None; ids.len()]);
            };
            partition::ensure(client, &stream, last.id, Need::Now)?;
            let target = partition::lock_for_insert(client, &stream, first.id, last.id)?;
            let shared = append::Shared { concurrency: policy, compaction, deliver_after };
            if !append::append(&stream, &target, &messages, &shared) {
                INSERT_MANY.run(
                    client,
                    stream.id,
                    &[
                        ids.clone().into(),
                        keys.clone().into(),
                        policy.map(Concurrency::as_str).into(),
                        compaction.into(),
                        payloads.into(),
                        stream.lanes.into(),
                        produced.clone().into(),
                        headers.into(),
                        deliver_after.into(),
                    ],
                )?;
            }
            let (written_ids, written_keys): (Vec<i64>, Vec<Option<&str>>) =
                messages.iter().map(|m| (m.id, m.key)).unzip();
            finish(client, &stream, &written_ids, &written_keys, compaction)?;
            Ok(ids.iter().map(|id| produced.as_ref().is_none_or(|p| p.contains(id)).then_some(*id)).collect())
        })
    })
}

/// Appends a message to a stream in the caller's transaction and returns its id. Consumers see
/// it when the transaction commits. Returns NULL (producing nothing) when idempotency_key was
/// already used within the stream's idempotency_ttl. `headers` (a JSON object) travel with the
/// message to `claim_with_metadata`; `deliver_after` holds it back that long from the
/// transaction's start.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn produce(
    stream: Option<Text<'_>>,
    payload: Option<RawJsonb>,
    message_key: default!(Option<RawText<'_>>, "NULL"),
    concurrency: default!(Option<Text<'_>>, "NULL"),
    compaction: default!(Option<bool>, false),
    idempotency_key: default!(Option<RawText<'_>>, "NULL"),
    headers: default!(Option<RawJsonb>, "NULL"),
    deliver_after: default!(Option<Interval>, "NULL"),
) -> SqlResult<Option<i64>> {
    crate::standby::refuse_writes("produce")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let message_key = key_text("message_key", message_key)?;
    let idempotency_key = key_text("idempotency_key", idempotency_key)?;
    let request = ProduceRequest::validate(message_key, concurrency.as_deref(), compaction.unwrap_or(false))?;
    let payload = payload.ok_or_else(|| {
        StreamError::invalid(
            "payload must not be NULL",
            "Every message needs a payload; use 'null'::jsonb or '{}' for an empty one.",
        )
    })?;
    if idempotency_key.is_some_and(str::is_empty) {
        return Err(StreamError::invalid(
            "idempotency_key is empty",
            "Pass a non-empty idempotency key, or NULL to produce without one.",
        )
        .into());
    }
    if let Some(key) = idempotency_key {
        crate::names::check_key_length("idempotency_key", key)?;
    }
    let extras = Extras { headers, deliver_after: check_deliver_after(deliver_after, compaction.unwrap_or(false))? };
    Ok(produce_one(stream, payload, &request, idempotency_key, extras)?)
}

/// Checks a batch's idempotency keys: one per payload (NULL for a message without one), none
/// empty or too long.
fn check_idempotency_keys(keys: &[Option<&str>], count: usize) -> Result<()> {
    if keys.len() != count {
        return Err(StreamError::invalid(
            format!("idempotency_keys has {} elements but payloads has {count}", keys.len()),
            "Pass one idempotency key per payload (NULL for a message without one), or none at all.",
        ));
    }
    for key in keys.iter().flatten() {
        if key.is_empty() {
            return Err(StreamError::invalid(
                "an idempotency key of the batch is empty",
                "Pass non-empty idempotency keys, or NULL for a message without one.",
            ));
        }
        crate::names::check_key_length("idempotency_key", key)?;
    }
    Ok(())
}

/// A key argument as text, refused where it cannot be read as UTF-8 (src/text.rs), as names
/// are: the extension reads keys as UTF-8 (src/statement/text.rs), and a key that passed produce
/// must never make a later claim or outcome fail.
fn key_text<'a>(what: &str, key: Option<RawText<'a>>) -> Result<Option<&'a str>> {
    key.map(|key| key.utf8().ok_or_else(|| crate::text::refusal(what, key.bytes()))).transpose()
}

/// `key_text` of every element of a `text[]` of keys.
fn keys_text<'a>(what: &str, keys: Option<&'a Array<'_, RawText<'_>>>) -> Result<Option<Vec<Option<&'a str>>>> {
    keys.map(|keys| keys.iter().map(|key| key_text(what, key)).collect()).transpose()
}

/// Appends many messages in one call (the fast path) and returns their ids in payload order.
/// message_keys, when given, has one key per payload; concurrency and compaction apply to all.
/// idempotency_keys, when given, has one per payload: a message whose key was already used
/// (within the stream's idempotency_ttl, or earlier in the same batch) produces nothing and
/// its id is NULL.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn produce_batch(
    stream: Option<Text<'_>>,
    payloads: Option<RawJsonbArray>,
    message_keys: default!(Option<Array<'_, RawText<'_>>>, "NULL"),
    concurrency: default!(Option<Text<'_>>, "NULL"),
    compaction: default!(Option<bool>, false),
    idempotency_keys: default!(Option<Array<'_, RawText<'_>>>, "NULL"),
    headers: default!(Option<RawJsonbArray>, "NULL"),
    deliver_after: default!(Option<Interval>, "NULL"),
) -> std::result::Result<srf::SetOfIterator<'static, Option<i64>>, ErrorReport> {
    crate::standby::refuse_writes("produce_batch")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let payloads = payloads.ok_or_else(|| {
        StreamError::invalid("payloads must not be NULL", "Pass an array with one jsonb per message.")
    })?;
    let keys = keys_text("message_key", message_keys.as_ref())?;
    let idempotency = keys_text("idempotency_key", idempotency_keys.as_ref())?;
    let extras =
        BatchExtras { headers, deliver_after: check_deliver_after(deliver_after, compaction.unwrap_or(false))? };
    let ids =
        produce_many(stream, payloads, keys, concurrency.as_deref(), compaction.unwrap_or(false), idempotency, extras)?;
    Ok(srf::SetOfIterator::new(ids))
}
