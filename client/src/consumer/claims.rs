//! A claim: the call that hands the consumer its rows, and the result split into chains (rows
//! of one key that run one after the other).

use std::sync::Arc;

use tokio::time::Instant;
use tracing::{debug, Instrument};
use uuid::Uuid;

use super::runner::Ctx;
use crate::error::Result;
use crate::{sql, Concurrency};

/// One row of a claim result.
pub(super) struct Claimed {
    pub id: i64,
    pub concurrency: Concurrency,
    pub attempt: u32,
    /// The claim's row, which holds the payload: decoded from there, not copied first.
    pub row: tokio_postgres::Row,
    pub token: Uuid,
    pub run_after: Option<i64>,
    pub produced_at: std::time::SystemTime,
    pub headers: Option<serde_json::Value>,
}

impl Claimed {
    /// The message key, read from the row when needed (most deliveries copy it only once,
    /// into the handler's `Delivery`).
    pub fn key(&self) -> Option<&str> {
        self.row.get(1)
    }
}

/// A pooled connection that claims share: a claim sent while another is in flight goes out on
/// the same one (see `ClaimLoop::send_ahead`).
pub(super) type Conn = Arc<deadpool_postgres::Object>;

/// Claims up to `batch` rows for the consumer of `ctx` on `conn`, carrying `acks` (the previous
/// claim's).
pub(super) async fn claim<T, H>(
    ctx: Arc<Ctx<T, H>>,
    conn: Conn,
    batch: i32,
    acks: Option<(Uuid, Vec<i64>)>,
) -> Result<Vec<Claimed>> {
    let span = crate::trace_context::receive_span(&ctx.group.stream.name, &ctx.group.name, batch);
    async {
        let started = Instant::now();
        let claim = conn.prepare_cached(sql::CLAIM).await?;
        let rows = conn
            .query(
                &claim,
                &[
                    &ctx.group.stream.name,
                    &ctx.group.name,
                    &batch,
                    &ctx.config.lease.as_secs_f64(),
                    &acks.as_ref().map(|a| a.0),
                    &acks.as_ref().map(|a| &a.1),
                ],
            )
            .await?;
        ctx.counters.claimed_in(started.elapsed());
        debug!(claimed = rows.len());
        tracing::Span::current().record("messaging.batch.message_count", rows.len());
        Ok(rows
            .into_iter()
            .map(|r| Claimed {
                id: r.get(0),
                concurrency: r.get::<_, &str>(2).parse().unwrap_or(Concurrency::Parallel),
                attempt: r.get::<_, i32>(3).max(0) as u32,
                token: r.get(5),
                run_after: r.get(6),
                produced_at: r.get(7),
                headers: r.get(8),
                row: r,
            })
            .collect())
    }
    .instrument(span)
    .await
}

/// Splits a claim result into chains: a row with `run_after` follows the chain of that row.
pub(super) fn chains_of(rows: Vec<Claimed>) -> Vec<Chain> {
    split_chains(rows, |row| (row.id, row.run_after))
}

/// `chains_of` for any row type; `link` gives a row's id and its run_after.
fn split_chains<R>(rows: Vec<R>, link: impl Fn(&R) -> (i64, Option<i64>)) -> Vec<smallvec::SmallVec<[R; 1]>> {
    if rows.iter().all(|row| link(row).1.is_none()) {
        return rows.into_iter().map(|row| smallvec::smallvec![row]).collect();
    }
    // A claim's rows come in id order, and a row's run_after is an earlier row of the same
    // result: found by a binary search over the ids so far.
    let mut seen: Vec<(i64, usize)> = Vec::with_capacity(rows.len());
    let mut chains: Vec<smallvec::SmallVec<[R; 1]>> = Vec::with_capacity(rows.len());
    for row in rows {
        let (id, run_after) = link(&row);
        let index = match run_after.and_then(|p| seen.binary_search_by_key(&p, |(id, _)| *id).ok()) {
            Some(at) => seen[at].1,
            None => {
                chains.push(smallvec::SmallVec::new());
                chains.len() - 1
            }
        };
        match seen.last() {
            Some((last, _)) if *last >= id => {
                // Not in id order after all: keep the ids sorted.
                let at = seen.partition_point(|(seen_id, _)| *seen_id < id);
                seen.insert(at, (id, index));
            }
            _ => seen.push((id, index)),
        }
        chains[index].push(row);
    }
    chains
}

/// Rows of one claim that run one after the other (same key), in id order; mostly one row.
pub(super) type Chain = smallvec::SmallVec<[Claimed; 1]>;

#[cfg(test)]
mod tests {
    use super::split_chains;

    type Row = (i64, Option<i64>);

    fn ids(chains: Vec<smallvec::SmallVec<[Row; 1]>>) -> Vec<Vec<i64>> {
        chains.into_iter().map(|c| c.into_iter().map(|(id, _)| id).collect()).collect()
    }

    #[test]
    fn rows_without_run_after_are_chains_of_one() {
        let rows = vec![(1, None), (2, None), (5, None)];
        assert_eq!(ids(split_chains(rows, |r| *r)), [vec![1], vec![2], vec![5]]);
    }

    #[test]
    fn a_row_follows_the_chain_of_its_run_after() {
        // Keys a (1, 3, 6) and b (2, 4); 5 follows a row not in this claim: a chain of its own.
        let rows = vec![(1, None), (2, None), (3, Some(1)), (4, Some(2)), (5, Some(0)), (6, Some(3))];
        assert_eq!(ids(split_chains(rows, |r| *r)), [vec![1, 3, 6], vec![2, 4], vec![5]]);
    }

    #[test]
    fn rows_out_of_id_order_still_find_their_chain() {
        let rows = vec![(7, None), (3, None), (9, Some(3)), (8, Some(7)), (10, Some(9))];
        assert_eq!(ids(split_chains(rows, |r| *r)), [vec![7, 8], vec![3, 9, 10]]);
    }
}
