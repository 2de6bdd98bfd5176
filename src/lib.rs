//! sqlstreams: durable message streams inside PostgreSQL, with consumer groups and per-key
//! `parallel` / `exclusive` / `ordered` delivery.
//!
//! The SQL API (docs/sql-api.md) is a set of functions in schema `sqlstreams`. Each
//! `#[pg_extern]` here is a thin shim: it validates and converts its arguments, calls plain Rust
//! that returns `Result<_, StreamError>`, and converts the error into an `ErrorReport` with the
//! contract's SQLSTATE. Pure decisions (policy resolution, the key gate, the fence, backoff)
//! have no SPI in them and are covered by `#[test]`s next to the code.

// Shims return pgrx's `ErrorReport` by value (pgrx raises it with its SQLSTATE only when it sees
// that exact type), and spell `TableIterator` row tuples inline (the schema generator reads the
// signature syntactically, so a type alias would not resolve).
#![allow(clippy::result_large_err, clippy::type_complexity)]

use pgrx::prelude::*;

::pgrx::pg_module_magic!(name, version);

mod access;
mod backoff;
mod bounds;
mod catalog;
mod claim;
mod clock;
mod commit;
mod concurrency;
mod cursor;
mod dead_letters;
mod drop_guard;
mod due;
mod error;
mod exception_queue;
mod fence;
mod group;
mod inspect;
mod key_gate;
mod lanes;
mod lease;
mod locks;
mod maintain;
mod message;
mod names;
mod notify;
mod outcome;
mod own_claims;
mod partition;
mod payload;
mod produce;
mod range;
mod retention;
mod seek;
mod settings;
mod srf;
mod standby;
mod statement;
mod stream;
mod version;
mod worker;

/// Runs once per backend, when the library is loaded.
#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // pgrx attaches a Rust backtrace to the DETAIL of errors raised through it when the server
    // runs with RUST_BACKTRACE set; internals never go to the client, so never capture one.
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    catalog::init();
    commit::init();
    settings::init();
    worker::init();
}

// The install and upgrade scripts are written by hand (sql/sqlstreams--*.sql), and the install
// script is what pgrx's own `cargo pgrx install`, `package` and `schema` write: every function
// and trigger here says `sql = false`, so the file below is the whole schema. `scripts/rig test`
// checks that it declares each of them with the signature pgrx derives from the Rust one
// (tests/library_schema.rs writes the library's own declarations from what the library embeds),
// and that the installed script is this version's (so a version bump changes this path too).
pgrx::extension_sql_file!("../sql/sqlstreams--0.2.0.sql", name = "install", bootstrap);
