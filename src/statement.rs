//! SQL statements, prepared once per backend and per stream, and typed access to their rows.
//!
//! Each module declares its SQL as `Statement` constants. Table names inside are written with
//! the `@id@` placeholder and rendered with the stream's numeric id, never with user text; all
//! values travel as parameters. The first execution in a backend prepares and keeps the plan
//! (`SPI_keepplan`); later executions reuse it. A plan whose tables are dropped is re-planned by
//! Postgres' plan cache, so a recreated stream with a reused id still works.
//!
//! Rows are read by column name (`Columns`); a claim reads its messages by position, each row
//! deformed once (`Row`: from a statement's result, `Deformed`, or from a partition's key without
//! a statement, src/message/scan.rs), as many as a hundred rows of nine columns per call; a
//! question of whether any row exists is read from an index the same way (src/statement/probe.rs).

use std::cell::RefCell;
use std::rc::Rc;

use foldhash::HashMap;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, PgBuiltInOids, PgOid};
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiHeapTupleData, SpiResult, SpiTupleTable};
use pgrx::{FromDatum, IntoDatum, PgMemoryContexts};

use crate::error::{Result, StreamError};

pub mod probe;
mod text;
pub use text::text_array;

/// Whether a call may write. Inspection functions are declared `stable`: they read the
/// caller's snapshot through read-only SPI; everything else takes a fresh snapshot per statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// One SQL statement with typed parameters.
pub struct Statement {
    /// Unique name, used as the cache key together with the stream id.
    pub name: &'static str,
    /// SQL text; `@id@` is replaced by the stream id.
    pub sql: &'static str,
    pub params: &'static [PgBuiltInOids],
}

/// The stream a statement runs against; 0 for catalog statements.
pub type StreamId = i64;

/// A partition of the stream's log (src/partition.rs): `@part@` in a statement's SQL.
pub type Part = i64;

/// Plans are kept per (stream, statement, read-only, partition named by `@part@`).
type PlanKey = (StreamId, &'static str, bool, Option<Part>);

/// Plans kept per statement and stream for single partitions: the partitions a claim reads move
/// on with the head, so the oldest plans go (a plan is a few kilobytes of backend memory). A
/// claim reads one or two partitions, and lanes found empty move up with the head
/// (src/lanes.rs); a walk over more (a lane whose retries fill every batch, a group far behind)
/// makes the plans past these again.
const PART_PLANS_KEPT: usize = 32;

thread_local! {
    static PLANS: RefCell<HashMap<PlanKey, Rc<OwnedPreparedStatement>>> = RefCell::new(HashMap::default());
    /// The plans `read_newest` runs, per (stream, statement).
    static NEWEST_PLANS: RefCell<HashMap<(StreamId, &'static str), KeptPlan>> = RefCell::new(HashMap::default());
}

/// A plan kept with `SPI_keepplan`, freed when dropped.
struct KeptPlan(pg_sys::SPIPlanPtr);

impl Drop for KeptPlan {
    fn drop(&mut self) {
        // SAFETY: a plan this module kept, freed once.
        unsafe { pg_sys::SPI_freeplan(self.0) };
    }
}

/// Renders a per-stream SQL template. Only ever called with a numeric id.
pub fn render(sql: &str, stream_id: StreamId) -> String {
    sql.replace("@id@", &stream_id.to_string())
}

fn render_part(sql: &str, stream_id: StreamId, part: Option<Part>) -> String {
    match part {
        Some(part) => render(sql, stream_id).replace("@part@", &part.to_string()),
        None => render(sql, stream_id),
    }
}

impl Statement {
    /// The SQL as prepared, behind a comment with the statement's name: pg_stat_statements,
    /// pg_stat_activity and the server log then say which statement of the library it is
    /// (docs/benchmarks/results.md breaks a claim down by these names).
    fn labelled(&self, sql: String) -> String {
        format!("/* sqlstreams {} */ {sql}", self.name)
    }

    /// Runs the statement against `stream_id`'s tables and returns its rows.
    ///
    /// Plans are prepared as "mutating": SPI then takes a fresh snapshot per statement under
    /// READ COMMITTED, which the claim path relies on (it must see rows committed after the
    /// calling statement started). A plain SELECT run this way still assigns no transaction id.
    pub fn run<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stream_id: StreamId,
        args: &[DatumWithOid<'_>],
    ) -> SpiResult<SpiTupleTable<'conn>> {
        let plan = self.plan(client, stream_id, None, false)?;
        let _planned = crate::transient::guide(self.name);
        client.select(&*plan, None, args)
    }

    /// Runs the statement with `access` (see `exec`) against partition `part` of the stream's
    /// log (`@part@`), which the caller knows exists (src/partition.rs). A plan over one
    /// partition locks that partition alone: a cached plan over the partitioned log locks every
    /// partition at each execution.
    pub fn exec_in<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stream_id: StreamId,
        part: Part,
        args: &[DatumWithOid<'_>],
        access: Access,
    ) -> SpiResult<SpiTupleTable<'conn>> {
        let plan = self.plan(client, stream_id, Some(part), access == Access::Read)?;
        let _planned = crate::transient::guide(self.name);
        client.select(&*plan, None, args)
    }

    /// Runs a read-only statement for a function declared `stable`: it reads the caller's
    /// snapshot and cannot write.
    pub fn read<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stream_id: StreamId,
        args: &[DatumWithOid<'_>],
    ) -> SpiResult<SpiTupleTable<'conn>> {
        let plan = self.plan(client, stream_id, None, true)?;
        let _planned = crate::transient::guide(self.name);
        client.select(&*plan, None, args)
    }

    /// Runs the statement with `access`: `read` for `Access::Read`, `run` otherwise.
    pub fn exec<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stream_id: StreamId,
        args: &[DatumWithOid<'_>],
        access: Access,
    ) -> SpiResult<SpiTupleTable<'conn>> {
        match access {
            Access::Read => self.read(client, stream_id, args),
            Access::Write => self.run(client, stream_id, args),
        }
    }

    /// `exec`, its rows read through `Deformed`.
    pub fn exec_deformed<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stream_id: StreamId,
        args: &[DatumWithOid<'_>],
        access: Access,
    ) -> SpiResult<Deformed<'conn>> {
        let table = self.exec(client, stream_id, args, access)?;
        // SAFETY: `table` is the result SPI just returned; no SPI call ran since.
        Ok(unsafe { Deformed::new(table) })
    }

    /// `exec_in`, its rows read through `Deformed`.
    pub fn exec_in_deformed<'conn>(
        &self,
        client: &SpiClient<'conn>,
        stream_id: StreamId,
        part: Part,
        args: &[DatumWithOid<'_>],
        access: Access,
    ) -> SpiResult<Deformed<'conn>> {
        let table = self.exec_in(client, stream_id, part, args, access)?;
        // SAFETY: `table` is the result SPI just returned; no SPI call ran since.
        Ok(unsafe { Deformed::new(table) })
    }

    fn plan(
        &self,
        client: &SpiClient<'_>,
        stream_id: StreamId,
        part: Option<Part>,
        read_only: bool,
    ) -> SpiResult<Rc<OwnedPreparedStatement>> {
        crate::search_path::pin();
        let key = (stream_id, self.name, read_only, part);
        if let Some(plan) = PLANS.with(|plans| plans.borrow().get(&key).cloned()) {
            return Ok(plan);
        }
        let types: Vec<PgOid> = self.params.iter().map(|oid| PgOid::BuiltIn(*oid)).collect();
        let sql = self.labelled(render_part(self.sql, stream_id, part));
        crate::transient::check_listed(self.name, &sql);
        let prepared =
            if read_only { client.prepare(sql.as_str(), &types)? } else { client.prepare_mut(sql.as_str(), &types)? };
        let plan = Rc::new(prepared.keep());
        PLANS.with(|plans| {
            let mut plans = plans.borrow_mut();
            if part.is_some() {
                forget_oldest_parts(&mut plans, key);
            }
            plans.insert(key, plan.clone())
        });
        Ok(plan)
    }
}

/// Makes room for the plan `key` of a partition: drops the plans of the lowest partitions
/// beyond `PART_PLANS_KEPT - 1` of the same statement and stream.
fn forget_oldest_parts<P>(plans: &mut HashMap<PlanKey, P>, key: PlanKey) {
    let same = |k: &&PlanKey| k.0 == key.0 && k.1 == key.1 && k.2 == key.2;
    let mut parts: Vec<Part> = plans.keys().filter(same).filter_map(|k| k.3).collect();
    if parts.len() < PART_PLANS_KEPT {
        return;
    }
    parts.sort_unstable();
    for part in &parts[..=parts.len() - PART_PLANS_KEPT] {
        plans.remove(&(key.0, key.1, key.2, Some(*part)));
    }
}

/// Forgets the cached plans of a dropped stream.
pub fn forget_stream(stream_id: StreamId) {
    PLANS.with(|plans| plans.borrow_mut().retain(|(id, _, _, _), _| *id != stream_id));
    NEWEST_PLANS.with(|plans| plans.borrow_mut().retain(|(id, _), _| *id != stream_id));
}

/// A `timestamptz` parameter from Postgres microseconds.
pub fn timestamptz<'a>(micros: pg_sys::TimestampTz) -> DatumWithOid<'a> {
    // SAFETY: timestamptz is a by-value int8 datum.
    unsafe { DatumWithOid::new(micros, pg_sys::TIMESTAMPTZOID) }
}

/// A nullable `timestamptz` parameter.
pub fn timestamptz_opt<'a>(micros: Option<pg_sys::TimestampTz>) -> DatumWithOid<'a> {
    match micros {
        Some(micros) => timestamptz(micros),
        None => DatumWithOid::null_oid(pg_sys::TIMESTAMPTZOID),
    }
}

/// A `timestamptz[]` parameter; `None` elements are NULL.
pub fn timestamptz_array<'a>(micros: Vec<Option<pg_sys::TimestampTz>>) -> DatumWithOid<'a> {
    let values: Vec<Option<pgrx::datum::TimestampWithTimeZone>> = micros
        .into_iter()
        .map(|m| m.map(|m| pgrx::datum::TimestampWithTimeZone::try_from(m).expect("finite timestamp")))
        .collect();
    DatumWithOid::from(values)
}

impl Statement {
    /// Runs a read-only statement whose columns are all `int8` with the newest snapshot rather
    /// than the caller's, as Postgres' foreign-key checks do: for rows that transactions
    /// committed after the caller's snapshot was taken, such as the outcomes recorded while it
    /// waited for a row's lock (src/range.rs), under any isolation level. `args` are not NULL.
    /// Returns each row's columns in order. (`_client`: this runs inside its SPI connection.)
    pub fn read_newest(
        &self,
        _client: &SpiClient<'_>,
        stream_id: StreamId,
        args: &[pg_sys::Datum],
    ) -> Result<Vec<Vec<Option<i64>>>> {
        debug_assert_eq!(args.len(), self.params.len());
        crate::search_path::pin();
        let plan = NEWEST_PLANS.with(|plans| -> Result<pg_sys::SPIPlanPtr> {
            let mut plans = plans.borrow_mut();
            if let Some(plan) = plans.get(&(stream_id, self.name)) {
                return Ok(plan.0);
            }
            let sql = self.labelled(render(self.sql, stream_id));
            crate::transient::check_listed(self.name, &sql);
            let sql = std::ffi::CString::new(sql).expect("no NUL in statements");
            let mut types: Vec<pg_sys::Oid> = self.params.iter().map(|oid| PgOid::BuiltIn(*oid).value()).collect();
            // SAFETY: prepares and keeps a plan inside the caller's SPI connection.
            let plan = unsafe { pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr()) };
            // SAFETY: as above; `SPI_keepplan` fails only for a plan that is null or kept.
            if plan.is_null() || unsafe { pg_sys::SPI_keepplan(plan) } != 0 {
                return Err(StreamError::Internal(format!("could not prepare statement {}", self.name)));
            }
            plans.insert((stream_id, self.name), KeptPlan(plan));
            Ok(plan)
        })?;
        let mut values = args.to_vec();
        let nulls = vec![b' ' as std::ffi::c_char; args.len()];
        let _planned = crate::transient::guide(self.name);
        // SAFETY: runs a kept plan with its arguments in the caller's SPI connection, read-only,
        // with the newest snapshot (SPI pushes it for the statement); then reads and frees the
        // result table, whose columns are int8.
        unsafe {
            let status = pg_sys::SPI_execute_snapshot(
                plan,
                values.as_mut_ptr(),
                nulls.as_ptr(),
                pg_sys::GetLatestSnapshot(),
                std::ptr::null_mut(),
                true,
                false,
                0,
            );
            if status != pg_sys::SPI_OK_SELECT as i32 {
                return Err(StreamError::Internal(format!("statement {} failed: {status}", self.name)));
            }
            let table = pg_sys::SPI_tuptable;
            let columns = (*(*table).tupdesc).natts;
            let mut rows = Vec::with_capacity(pg_sys::SPI_processed as usize);
            for i in 0..pg_sys::SPI_processed as usize {
                let tuple = *(*table).vals.add(i);
                let row = (1..=columns)
                    .map(|column| {
                        let mut null = false;
                        let datum = pg_sys::SPI_getbinval(tuple, (*table).tupdesc, column, &mut null);
                        i64::from_datum(datum, null)
                    })
                    .collect();
                rows.push(row);
            }
            pg_sys::SPI_freetuptable(table);
            Ok(rows)
        }
    }
}

/// A result's rows, each deformed in one pass (`heap_deform_tuple`), for the rows a claim reads
/// by the hundred. pgrx reads a row with two guarded FFI calls per column (`SPI_getbinval`,
/// `SPI_gettypeid`), and `SPI_getbinval` walks the tuple from its start for every column after a
/// NULL or a variable-length value: for a message row that cost as much as running its query.
pub struct Deformed<'conn> {
    /// Ties the rows to the SPI connection, which frees them when it ends.
    _table: SpiTupleTable<'conn>,
    tupdesc: pg_sys::TupleDesc,
    tuples: *mut pg_sys::HeapTuple,
    /// How many rows `tuples` holds: 0 for a statement that returned no table.
    len: usize,
    types: Vec<pg_sys::Oid>,
    /// Where values that outlive the SPI connection are copied: the parent of SPI's context
    /// (the transaction's, for pgrx's atomic connections), as pgrx does for the rows it reads.
    caller: pg_sys::MemoryContext,
}

impl<'conn> Deformed<'conn> {
    /// # Safety
    /// `table` must be the result SPI returned last (`SPI_tuptable`).
    unsafe fn new(table: SpiTupleTable<'conn>) -> Deformed<'conn> {
        // SAFETY: the caller's promise. A statement that returns no rows (an INSERT without
        // RETURNING) leaves no table, though `table.len()` then counts the rows it processed.
        let (tupdesc, tuples, len) = unsafe {
            match pg_sys::SPI_tuptable.as_ref() {
                Some(t) if !t.tupdesc.is_null() && !t.vals.is_null() => {
                    debug_assert_eq!(t.numvals as usize, table.len(), "the table SPI returned last");
                    (t.tupdesc, t.vals, t.numvals as usize)
                }
                _ => (std::ptr::null_mut(), std::ptr::null_mut(), 0),
            }
        };
        let types = if tupdesc.is_null() {
            vec![]
        } else {
            // SAFETY: a valid tuple descriptor; attributes are 1-based for SPI.
            unsafe { (1..=(*tupdesc).natts).map(|i| pg_sys::SPI_gettypeid(tupdesc, i)).collect() }
        };
        Deformed { _table: table, tupdesc, tuples, len, types, caller: caller_context() }
    }

    /// `f` of every row, in order.
    pub fn map<T>(self, mut f: impl FnMut(&Row<'_>) -> Result<T>) -> Result<Vec<T>> {
        let len = self.len;
        let mut out = Vec::with_capacity(len);
        let mut values = vec![pg_sys::Datum::from(0); self.types.len()];
        let mut nulls = vec![true; self.types.len()];
        for i in 0..len {
            // SAFETY: `i` is below the table's row count; the buffers hold one entry per column.
            unsafe {
                pg_sys::heap_deform_tuple(*self.tuples.add(i), self.tupdesc, values.as_mut_ptr(), nulls.as_mut_ptr())
            };
            out.push(f(&Row { values: &values, nulls: &nulls, types: &self.types, caller: self.caller })?);
        }
        Ok(out)
    }
}

/// Where values read inside an SPI connection and kept past it are copied: the parent of SPI's
/// procedure context (the transaction's, for pgrx's atomic connections), as pgrx does for the
/// rows it reads. SPI's context is current inside a connection: nothing of the library switches
/// to another around its reads.
pub fn caller_context() -> pg_sys::MemoryContext {
    debug_assert_eq!(
        // SAFETY: the current context is valid and has a NUL-terminated name.
        unsafe { std::ffi::CStr::from_ptr((*pg_sys::CurrentMemoryContext).name) },
        c"SPI Proc",
        "read inside an SPI connection"
    );
    // SAFETY: the current context is valid; its parent outlives it.
    unsafe { PgMemoryContexts::CurrentMemoryContext.parent() }.expect("SPI runs in a context of its caller").value()
}

/// One row of a `Deformed` result, or of a scan (src/message/scan.rs, src/statement/probe.rs).
pub struct Row<'a> {
    values: &'a [pg_sys::Datum],
    nulls: &'a [bool],
    types: &'a [pg_sys::Oid],
    caller: pg_sys::MemoryContext,
}

impl<'a> Row<'a> {
    /// A row read without SPI (src/message/scan.rs, src/statement/probe.rs): one value, null
    /// flag and type per column; values the caller keeps are copied into `caller`.
    ///
    /// # Safety
    /// Each value that is not NULL is a valid datum of its column's type, and stays valid while
    /// the row is used; `caller` is a live memory context.
    pub unsafe fn of(
        values: &'a [pg_sys::Datum],
        nulls: &'a [bool],
        types: &'a [pg_sys::Oid],
        caller: pg_sys::MemoryContext,
    ) -> Row<'a> {
        Row { values, nulls, types, caller }
    }

    /// The value at `ordinal` (1-based); `None` for SQL NULL.
    pub fn get<T: FromDatum + IntoDatum>(&self, ordinal: usize) -> Result<Option<T>> {
        let i = ordinal - 1;
        // Only where `T` is read as text (String, Vec<Option<String>>, ...): decided when this
        // is compiled for `T`, so reading any other type costs nothing (a claim reads hundreds).
        if crate::text::is_text(T::type_oid()) && !self.nulls[i] {
            crate::text::check_stored(self.values[i], false, self.types[i])?;
        }
        // SAFETY: the datum and its null flag come from the row, with the column's type.
        let value = unsafe {
            T::try_from_datum_in_memory_context(
                PgMemoryContexts::For(self.caller),
                self.values[i],
                self.nulls[i],
                self.types[i],
            )
        };
        Ok(value.map_err(pgrx::spi::Error::DatumError)?)
    }
}

/// Typed access to a result row by column name.
pub trait Columns {
    /// The column's value; `None` for SQL NULL.
    fn value<T: FromDatum + IntoDatum>(&self, column: &str) -> Result<Option<T>>;

    /// The column's value, which the statement guarantees is not NULL.
    fn required<T: FromDatum + IntoDatum>(&self, column: &str) -> Result<T> {
        self.value(column)?.ok_or_else(|| StreamError::Internal(format!("column {column} is unexpectedly NULL")))
    }
}

impl Columns for SpiHeapTupleData<'_> {
    fn value<T: FromDatum + IntoDatum>(&self, column: &str) -> Result<Option<T>> {
        if !crate::text::checks_stored() {
            return Ok(self.get_by_name(column)?);
        }
        let entry = self.get_datum_by_name(column)?;
        if let Some(Stored(datum)) = entry.value::<Stored>()? {
            crate::text::check_stored(datum, false, entry.oid())?;
        }
        Ok(entry.value()?)
    }
}

/// The current row of a table (after `first()`).
impl Columns for SpiTupleTable<'_> {
    fn value<T: FromDatum + IntoDatum>(&self, column: &str) -> Result<Option<T>> {
        if !crate::text::checks_stored() {
            return Ok(self.get_by_name(column)?);
        }
        let ordinal = self.column_ordinal(column)?;
        if let Some(datum) = self.get_datum_by_ordinal(ordinal)? {
            crate::text::check_stored(datum, false, self.column_type_oid(ordinal)?.value())?;
        }
        Ok(self.get(ordinal)?)
    }
}

/// A column's datum as it is, of any type: what `text::check_stored` looks at before pgrx
/// converts it.
struct Stored(pg_sys::Datum);

impl FromDatum for Stored {
    unsafe fn from_polymorphic_datum(datum: pg_sys::Datum, is_null: bool, _: pg_sys::Oid) -> Option<Self> {
        (!is_null).then_some(Stored(datum))
    }
}

/// Only ever read (`FromDatum`), never bound as a parameter: its type is any type.
impl IntoDatum for Stored {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        unreachable!("a column's datum is read, never passed as a parameter")
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::TEXTOID
    }

    fn is_compatible_with(_: pg_sys::Oid) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_keeps_the_plans_of_its_newest_partitions() {
        let mut plans: HashMap<PlanKey, ()> = HashMap::default();
        plans.insert((1, "other", false, Some(0)), ());
        plans.insert((2, "after", false, Some(0)), ());
        plans.insert((1, "after", false, None), ());
        for part in 0..100 {
            let key = (1, "after", false, Some(part));
            forget_oldest_parts(&mut plans, key);
            plans.insert(key, ());
        }
        let mut kept: Vec<Part> = plans.keys().filter(|k| k.0 == 1 && k.1 == "after").filter_map(|k| k.3).collect();
        kept.sort_unstable();
        assert_eq!(kept, (100 - PART_PLANS_KEPT as Part..100).collect::<Vec<_>>());
        assert!(plans.contains_key(&(1, "other", false, Some(0))), "other statements keep theirs");
        assert!(plans.contains_key(&(2, "after", false, Some(0))), "other streams keep theirs");
        assert!(plans.contains_key(&(1, "after", false, None)), "the plan without a partition stays");
    }
}
