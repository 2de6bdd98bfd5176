//! The SQL functions `claim` and `claim_with_metadata`: their arguments checked (nothing
//! changes when one is refused), the claim run, and its rows returned at once.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use super::{claim, CarriedAcks, Delivery, MAX_BATCH};
use crate::error::{Result, StreamError};
use crate::key::Key;
use crate::names::{self, positive_micros, validate_name};
use crate::payload::RawJsonb;
use crate::srf;
use crate::text::Text;

/// The arguments both claim functions share, checked.
struct ClaimArgs<'a> {
    stream: &'a str,
    group_name: &'a str,
    batch: i32,
    lease_micros: i64,
    carried: Option<CarriedAcks>,
}

impl<'a> ClaimArgs<'a> {
    fn check(
        stream: Option<Text<'a>>,
        group_name: Option<Text<'a>>,
        batch_size: Option<i32>,
        lease: Option<Interval>,
        ack_lease_token: Option<pgrx::Uuid>,
        ack_message_ids: Option<Vec<Option<i64>>>,
    ) -> Result<Self> {
        let stream = validate_name("stream", stream.map(Text::into_str))?;
        let group_name = validate_name("group", group_name.map(Text::into_str))?;
        let batch = match batch_size {
            Some(n) if (1..=MAX_BATCH).contains(&n) => n,
            other => {
                return Err(StreamError::invalid(
                    format!("batch_size {} is not valid", other.map_or("NULL".into(), |n| n.to_string())),
                    format!("Pass a batch_size between 1 and {MAX_BATCH}."),
                ))
            }
        };
        let lease_micros = crate::settings::check_lease(
            "lease",
            positive_micros("lease", lease.map(|l| l.as_micros()), "'30 seconds'")?,
        )?;
        let carried = match (ack_lease_token, ack_message_ids) {
            (Some(token), ids @ Some(_)) => {
                Some(CarriedAcks { token, ids: names::message_ids("ack_message_ids", ids)? })
            }
            (None, None) => None,
            _ => {
                return Err(StreamError::invalid(
                    "ack_lease_token and ack_message_ids go together",
                    "Pass both (to ack an earlier claim's messages first) or neither.",
                ))
            }
        };
        Ok(ClaimArgs { stream, group_name, batch, lease_micros, carried })
    }

    /// Declared without `SET` clauses: the claim pins its settings when it runs SQL
    /// (src/search_path.rs).
    fn claim(self) -> Result<Vec<Delivery>> {
        crate::search_path::when_needed(|| {
            claim(self.stream, self.group_name, self.batch, self.lease_micros, self.carried)
        })
    }
}

/// Claims work for a consumer of `group_name`: messages of a freshly claimed (or reclaimed)
/// range and due exception-queue rows, in message_id order, all under one lease. Rows with a
/// run_after wait for that earlier row of the same result. Messages that must wait are recorded
/// deferred, superseded ones superseded; neither is returned. An idle call writes nothing.
///
/// `ack_lease_token` and `ack_message_ids` (optional) record successes of an earlier claim
/// first, in the same transaction: a consumer that acks and claims again pays one round trip
/// and one commit instead of two.
#[pg_extern(volatile, parallel_unsafe, name = "claim", sql = false)]
fn claim_sql(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    batch_size: default!(Option<i32>, 100),
    lease: default!(Option<Interval>, "'30 seconds'"),
    ack_lease_token: default!(Option<pgrx::Uuid>, "NULL"),
    ack_message_ids: default!(Option<Vec<Option<i64>>>, "NULL"),
) -> Result<
    srf::TableIterator<
        'static,
        (
            name!(message_id, i64),
            name!(message_key, Option<Key>),
            name!(concurrency, &'static str),
            name!(attempt, i32),
            name!(payload, RawJsonb),
            name!(lease_token, pgrx::Uuid),
            name!(run_after, Option<i64>),
        ),
    >,
    ErrorReport,
> {
    crate::standby::refuse_writes("claim")?;
    let args = ClaimArgs::check(stream, group_name, batch_size, lease, ack_lease_token, ack_message_ids)?;
    Ok(srf::TableIterator::new(args.claim()?.into_iter().map(|d| {
        (d.message_id, d.message_key, d.concurrency.as_str(), d.attempt, d.payload, d.lease_token, d.run_after)
    })))
}

/// `claim`, with two more columns: when each message was produced and its headers. The
/// contract fixes `claim`'s columns, so the longer row has a function of its own.
#[pg_extern(volatile, parallel_unsafe, name = "claim_with_metadata", sql = false)]
fn claim_with_metadata_sql(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    batch_size: default!(Option<i32>, 100),
    lease: default!(Option<Interval>, "'30 seconds'"),
    ack_lease_token: default!(Option<pgrx::Uuid>, "NULL"),
    ack_message_ids: default!(Option<Vec<Option<i64>>>, "NULL"),
) -> Result<
    srf::TableIterator<
        'static,
        (
            name!(message_id, i64),
            name!(message_key, Option<Key>),
            name!(concurrency, &'static str),
            name!(attempt, i32),
            name!(payload, RawJsonb),
            name!(lease_token, pgrx::Uuid),
            name!(run_after, Option<i64>),
            name!(produced_at, TimestampWithTimeZone),
            name!(headers, Option<RawJsonb>),
        ),
    >,
    ErrorReport,
> {
    crate::standby::refuse_writes("claim_with_metadata")?;
    let args = ClaimArgs::check(stream, group_name, batch_size, lease, ack_lease_token, ack_message_ids)?;
    let rows: Vec<_> = args
        .claim()?
        .into_iter()
        .map(|d| {
            let produced_at = TimestampWithTimeZone::try_from(d.meta.produced_at)
                .map_err(|_| StreamError::Internal(format!("message {} has no finite produced_at", d.message_id)))?;
            Ok((
                d.message_id,
                d.message_key,
                d.concurrency.as_str(),
                d.attempt,
                d.payload,
                d.lease_token,
                d.run_after,
                produced_at,
                d.meta.headers,
            ))
        })
        .collect::<Result<_>>()?;
    Ok(srf::TableIterator::new(rows))
}
