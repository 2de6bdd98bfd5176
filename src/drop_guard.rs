//! `DROP EXTENSION sqlstreams` (or `DROP SCHEMA sqlstreams CASCADE`) while streams exist would
//! drop the catalog, which names the streams, their groups and grants, and leave each stream's
//! tables behind with nothing that can reattach them. An event trigger refuses it first, with
//! CASCADE too, and says how to drop the streams. Without streams the extension drops as any.
//!
//! Postgres does not fire event triggers in single-user mode (nor, on 17 and later, with
//! `event_triggers = off`): a superuser who turns them off takes the drop on themselves.

use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgList;

use crate::error::StreamError;

/// The name both the extension and its schema have.
const NAME: &CStr = c"sqlstreams";

#[no_mangle]
pub extern "C" fn pg_finfo_refuse_drop() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// The `ddl_command_start` event trigger on `DROP EXTENSION` and `DROP SCHEMA`
/// (`sqlstreams.refuse_drop()`, declared `RETURNS event_trigger` in the install script).
///
/// # Safety
/// Called by Postgres' function manager with an event trigger's call info.
#[pg_guard]
#[no_mangle]
pub unsafe extern "C-unwind" fn refuse_drop(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: fcinfo comes from the function manager; its context says how we were called.
    let context = unsafe { (*fcinfo).context };
    if context.is_null() || unsafe { (*context).type_ } != pg_sys::NodeTag::T_EventTriggerData {
        error!("sqlstreams.refuse_drop() runs only as an event trigger");
    }
    // SAFETY: an EventTriggerData, as its tag says.
    let tree = unsafe { (*(context as *mut pg_sys::EventTriggerData)).parsetree };
    // SAFETY: the statement's parse tree; a DropStmt's objects of these kinds are String nodes.
    if unsafe { drops_sqlstreams(tree) } {
        let streams = Spi::get_one::<i64>("SELECT pg_catalog.count(*) FROM sqlstreams.stream")
            .unwrap_or_else(|e| error!("sqlstreams: counting streams before a drop: {e}"))
            .unwrap_or(0);
        if streams > 0 {
            let err: pgrx::pg_sys::panic::ErrorReport = StreamError::StreamsExist { streams }.into();
            err.report(PgLogLevel::ERROR);
        }
    }
    pg_sys::Datum::from(0)
}

/// Whether `tree` is a `DROP EXTENSION` or `DROP SCHEMA` that names `sqlstreams`.
///
/// # Safety
/// `tree` is a parse tree node.
unsafe fn drops_sqlstreams(tree: *mut pg_sys::Node) -> bool {
    if tree.is_null() || unsafe { (*tree).type_ } != pg_sys::NodeTag::T_DropStmt {
        return false;
    }
    let drop = tree as *mut pg_sys::DropStmt;
    let kind = unsafe { (*drop).removeType };
    if kind != pg_sys::ObjectType::OBJECT_EXTENSION && kind != pg_sys::ObjectType::OBJECT_SCHEMA {
        return false;
    }
    let objects = unsafe { PgList::<pg_sys::Node>::from_pg((*drop).objects) };
    let named = objects.iter_ptr().any(|node| {
        // SAFETY: the names of dropped extensions and schemas are String nodes.
        !node.is_null()
            && unsafe { (*node).type_ } == pg_sys::NodeTag::T_String
            && unsafe { CStr::from_ptr((*(node as *mut pg_sys::String)).sval) } == NAME
    });
    named
}
