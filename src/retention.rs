//! Retention: what no consumer group needs any more leaves the disk.
//!
//! A message is needed while some group has not committed past it. Below the lowest id a
//! group needs, whole partitions of the log are dropped; compaction heads below what the log
//! keeps go too (a head supersedes its key's older messages whenever they are handed out
//! again), unless a compacted message of their key may still run (a dead letter, which a
//! redrive brings back: the head must still supersede it).
//!
//! An exception row does not keep its partition: the messages rows still refer to (a dead
//! letter, readable and redrivable until its row goes) move to `message_archive_<id>` as their
//! partition is dropped, so a dead letter never makes every later partition stay, and claims
//! never open more partitions than groups need. Resolved exception rows (`dead`, `superseded`)
//! are kept for the stream's `dead_retention`; archived messages no row refers to any more go
//! with them.
//!
//! Nothing here waits for a row lock: rows another transaction holds (a producer's compaction
//! head, a row an outcome is changing) are left for the next step. The one wait is for the wake
//! lock of the lane of a held key whose dead row it purged, while a claim parks rows of that
//! lane (see `step`).
//!
//! Who runs it: `maintain()` (cron), and otherwise the consumers themselves: a claim runs one
//! bounded step for its stream at most once a minute per session, and only one session at a
//! time per stream (a try-lock). A partition drop never waits for the log's lock
//! (`sqlstreams.drop_partitions`), so a step never holds a stream back for long.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::cursor;
use crate::error::Result;
use crate::exception_queue::{self, Waker};
use crate::locks;
use crate::partition::Log;
use crate::statement::{Access, Columns, Statement};
use crate::stream::StreamRef;

/// How often one session runs a step for one stream from its claims.
const EVERY: Duration = Duration::from_secs(60);
/// Resolved exception rows removed per step.
const PURGE_BATCH: i64 = 10_000;

/// What one step removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retained {
    pub partitions_dropped: i64,
    pub rows_purged: i64,
}

const PURGE_RESOLVED: Statement = Statement {
    name: "retention_purge_resolved",
    sql: "DELETE FROM sqlstreams.exception_queue_@id@ WHERE ctid = ANY (ARRAY(
              SELECT ctid FROM sqlstreams.exception_queue_@id@
              WHERE status IN ('dead', 'superseded') AND consumer_group_id = ANY($3)
                AND updated_at < now() - (SELECT dead_retention FROM sqlstreams.stream WHERE id = $1)
              LIMIT $2 FOR UPDATE SKIP LOCKED))
          RETURNING consumer_group_id, message_key",
    params: &[INT8OID, INT8OID, INT8ARRAYOID],
};

/// The highest id below which no group needs the log: every group committed past it. NULL for a
/// stream without groups (its messages wait for one).
const NEEDED_FROM: Statement = Statement {
    name: "retention_needed_from",
    sql: "SELECT min(committed) AS below FROM sqlstreams.cursor_@id@",
    params: &[],
};

/// What a restore has not loaded yet of stream `@id@` (see `unrestored`), as the end of a
/// sentence; NULL when nothing. First a table of `$1` (names in schema `sqlstreams`), or a
/// partition of its log, without a valid primary key; then a group its cursors have that the
/// catalog does not (the catalog's rows load apart from the stream's tables).
const UNRESTORED: Statement = Statement {
    name: "retention_unrestored",
    sql: "WITH t AS (
              SELECT u.n, 'sqlstreams.' || u.name AS name FROM unnest($1::text[]) WITH ORDINALITY AS u(name, n)
              UNION ALL
              SELECT 1000, h.inhrelid::regclass::text FROM pg_catalog.pg_inherits h
              WHERE h.inhparent = pg_catalog.to_regclass('sqlstreams.message_log_@id@'))
          SELECT coalesce(
              (SELECT 'table ' || t.name || ' has no primary key yet' FROM t
               WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_index i
                                 WHERE i.indrelid = pg_catalog.to_regclass(t.name) AND i.indisprimary AND i.indisvalid)
               ORDER BY t.n, t.name LIMIT 1),
              (SELECT 'table sqlstreams.consumer_group has no row yet for group ' || c.consumer_group_id
                      || ' of its cursors'
               FROM sqlstreams.cursor_@id@ c
               WHERE NOT EXISTS (SELECT FROM sqlstreams.consumer_group g WHERE g.id = c.consumer_group_id)
               LIMIT 1)) AS missing",
    params: &[TEXTARRAYOID],
};

/// Archived messages no exception row refers to any more (their rows were purged, skipped or
/// dropped with their group): one primary-key probe per group of the stream for each archived
/// message (the archive holds dead letters only, so it stays small).
const PURGE_ARCHIVE: Statement = Statement {
    name: "retention_purge_archive",
    sql: "DELETE FROM sqlstreams.message_archive_@id@ WHERE ctid = ANY (ARRAY(
              SELECT a.ctid FROM sqlstreams.message_archive_@id@ a
              WHERE NOT EXISTS (SELECT 1 FROM sqlstreams.consumer_group g
                                JOIN sqlstreams.exception_queue_@id@ e
                                  ON e.consumer_group_id = g.id AND e.message_id = a.id
                                WHERE g.stream_id = $2)
              LIMIT $1 FOR UPDATE SKIP LOCKED))",
    params: &[INT8OID, INT8OID],
};

/// Compaction heads nothing needs: below every message the log still keeps (`$1`: a head
/// supersedes older messages of its key whenever they are handed out again, after a seek
/// backwards or to a new group), and of a key with no compacted message that may still run (a
/// dead letter may be redriven: its key's head must still supersede it).
const DROP_HEADS: Statement = Statement {
    name: "retention_drop_heads",
    sql: "DELETE FROM sqlstreams.compaction_head_@id@ WHERE ctid = ANY (ARRAY(
              SELECT h.ctid FROM sqlstreams.compaction_head_@id@ h
              WHERE h.message_id <= $1
                AND NOT EXISTS (SELECT 1 FROM sqlstreams.consumer_group g
                                JOIN sqlstreams.exception_queue_@id@ e
                                  ON e.consumer_group_id = g.id AND e.message_key = h.message_key
                                WHERE g.stream_id = $2 AND e.compaction AND e.status <> 'superseded')
              FOR UPDATE OF h SKIP LOCKED))",
    params: &[INT8OID, INT8OID],
};

const DROP_PARTITIONS: Statement = Statement {
    name: "retention_drop_partitions",
    sql: "SELECT sqlstreams.drop_partitions($1, $2) AS dropped",
    params: &[INT8OID, INT8OID],
};

/// Folds the exception counts into one row per group and status (the triggers keep a row per
/// writing backend; group_status sums them), so the rows of ended backends do not pile up.
/// Rows of dropped groups go. It takes only the rows no one else holds (a backend writing its
/// row now, or a concurrent fold from `maintain()` or another claim's step), so it never
/// waits, and the sums stay exact; a row it skipped stays for the next fold.
const FOLD_COUNTS: Statement = Statement {
    name: "retention_fold_counts",
    sql: "WITH gone AS (DELETE FROM sqlstreams.exception_count_@id@ WHERE ctid = ANY (ARRAY(
                  SELECT ctid FROM sqlstreams.exception_count_@id@ FOR UPDATE SKIP LOCKED))
              RETURNING consumer_group_id, status, delta)
          INSERT INTO sqlstreams.exception_count_@id@ (consumer_group_id, status, delta)
          SELECT g.consumer_group_id, g.status, sum(g.delta) FROM gone g
          WHERE EXISTS (SELECT 1 FROM sqlstreams.consumer_group c WHERE c.id = g.consumer_group_id)
          GROUP BY 1, 2 HAVING sum(g.delta) <> 0",
    params: &[],
};

const GROUPS: Statement = Statement {
    name: "retention_groups",
    sql: "SELECT g.id, g.name, s.name AS stream_name
          FROM sqlstreams.consumer_group g JOIN sqlstreams.stream s ON s.id = g.stream_id
          WHERE g.stream_id = $1 ORDER BY g.id",
    params: &[INT8OID],
};

/// The groups of `stream` whose lock (src/locks.rs) this transaction now holds, shared, taken
/// without waiting: retention and `maintain()` change the rows of these groups only. A group
/// that a `seek` or `drop_group` holds, or waits for, is left for the next step: taking its
/// cursor or exception rows would make the seek wait for this transaction, which may go on to
/// claim from that group and wait for the seek.
pub fn groups_to_maintain(client: &SpiClient<'_>, stream: &StreamRef) -> Result<Vec<i64>> {
    let mut groups = Vec::new();
    for row in GROUPS.run(client, 0, &[stream.id.into()])? {
        let (stream_name, group): (String, String) = (row.required("stream_name")?, row.required("name")?);
        if locks::try_group_shared(&stream_name, &group) {
            groups.push(row.required("id")?);
        }
    }
    Ok(groups)
}

/// What a restore has not loaded yet of what `stream`'s maintenance reads, if anything: one of
/// the tables that say what its groups still need (their cursors, lanes, open ranges with their
/// outcomes, exception rows), its archive or a partition of its log without its primary key, or
/// a group of its cursors missing from the catalog.
///
/// `pg_restore` (with `-j` or without) and a plain dump run with `psql` load a table's rows
/// before they add its primary key, and tables one after another, each committed on its own.
/// While one of these is still loading, the others say that nothing is needed where its rows
/// would: a cursor stored then would pass open ranges, unresolved rows or messages not loaded
/// yet for good, and retention would drop their messages (and, without the group's catalog
/// row, its counts and archived dead letters). Maintenance leaves such a stream alone until
/// everything is there (docs/operations.md, "What a dump keeps").
pub fn unrestored(client: &SpiClient<'_>, stream: &StreamRef) -> Result<Option<String>> {
    let id = stream.id;
    let tables: Vec<String> = ["cursor", "lane", "range_lease", "range_done", "exception_queue", "message_archive"]
        .iter()
        .map(|family| format!("{family}_{id}"))
        .collect();
    UNRESTORED.run(client, id, &[tables.into()])?.first().value("missing")
}

/// Stores the committed cursor of each of `groups` (`groups_to_maintain`), as `step` needs it;
/// returns how many moved.
pub fn advance(client: &SpiClient<'_>, stream: &StreamRef, groups: &[i64]) -> Result<i64> {
    let mut advanced = 0;
    for &group in groups {
        if cursor::advance(client, stream, group)?.is_some() {
            advanced += 1;
        }
    }
    Ok(advanced)
}

/// One step for `stream`, for `groups` (`groups_to_maintain`), whose cursors `advance` stored:
/// removes their expired resolved rows, folds the exception counts, then removes what nobody
/// needs below the rows.
pub fn step(client: &SpiClient<'_>, stream: &StreamRef, groups: &[i64]) -> Result<Retained> {
    let mut purged: HashMap<i64, Vec<Option<String>>> = HashMap::new();
    for row in PURGE_RESOLVED.run(client, stream.id, &[stream.id.into(), PURGE_BATCH.into(), groups.into()])? {
        purged.entry(row.required("consumer_group_id")?).or_default().push(row.value("message_key")?);
    }
    let rows_purged = purged.values().map(Vec::len).sum::<usize>() as i64;
    // A dead row that held its ordered key (on_dead = 'hold') is gone: its key goes on. This
    // wake-up waits for a claim parking rows of those keys' lanes right now (as an outcome's
    // does): that claim may still have seen the dead row and parked behind it for good, so it
    // must be woken after it commits. A claim never waits, so this wait is short and cannot
    // close a cycle.
    for (group_id, keys) in purged {
        let group = crate::group::by_id(client, stream, group_id)?;
        if !group.hold_on_dead {
            continue;
        }
        let keys = exception_queue::distinct_keys(&keys);
        exception_queue::after_resolution(client, &group, &keys, crate::clock::now(), Waker::Outcome)?;
    }
    crate::exception_queue::counts::writing(|| FOLD_COUNTS.run(client, stream.id, &[]))?;
    PURGE_ARCHIVE.run(client, stream.id, &[PURGE_BATCH.into(), stream.id.into()])?;
    let row = NEEDED_FROM.run(client, stream.id, &[])?;
    let below: Option<i64> = if row.is_empty() { None } else { row.first().value("below")? };
    let Some(below) = below else { return Ok(Retained { partitions_dropped: 0, rows_purged }) };
    let partitions_dropped: i32 =
        DROP_PARTITIONS.run(client, 0, &[stream.id.into(), below.into()])?.first().required("dropped")?;
    if let Some(oldest) = Log::open(stream)?.oldest(client, Access::Write)? {
        // Below the first id the log keeps.
        DROP_HEADS.run(client, stream.id, &[(oldest * stream.partition_size).into(), stream.id.into()])?;
    }
    Ok(Retained { partitions_dropped: partitions_dropped.into(), rows_purged })
}

thread_local! {
    /// When this session last ran a step from a claim, per stream.
    static LAST: RefCell<HashMap<i64, Instant>> = RefCell::new(HashMap::new());
}

/// From a claim: a step for `stream` when this session has not run one for a minute and no
/// other session is running one now.
pub fn from_claim(client: &SpiClient<'_>, stream: &StreamRef) -> Result<()> {
    let due = LAST.with(|last| last.borrow().get(&stream.id).is_none_or(|at| at.elapsed() >= EVERY));
    if !due {
        return Ok(());
    }
    LAST.with(|last| last.borrow_mut().insert(stream.id, Instant::now()));
    if locks::try_retention(stream.id) && unrestored(client, stream)?.is_none() {
        let groups = groups_to_maintain(client, stream)?;
        advance(client, stream, &groups)?;
        step(client, stream, &groups)?;
    }
    Ok(())
}
