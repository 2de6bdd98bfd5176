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
mod admin;
mod append;
mod backoff;
mod bounds;
mod catalog;
mod claim;
mod clock;
mod commit;
mod concurrency;
mod cursor;
mod drop_guard;
mod due;
mod error;
mod exception_queue;
mod fence;
mod group;
mod head;
mod inflight_cap;
mod inspect;
mod key;
mod key_gate;
mod lanes;
mod lease;

mod locks;
mod message;
mod names;
mod notify;
mod outcome;
mod own_claims;
mod partition;
mod payload;
mod produce;
mod quiet;
mod range;
mod retention;
mod search_path;
mod settings;
mod srf;
mod standby;
mod statement;
mod stream;
mod subtransaction;
mod text;
mod token;
mod transient;
mod version;
mod worker;

/// Runs once per backend, when the library is loaded.
#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // pgrx attaches a Rust backtrace to the DETAIL of errors raised through it when the server
    // runs with RUST_BACKTRACE set; internals never go to the client, so never capture one.
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    catalog::init();
    fence::init();
    commit::init();
    settings::init();
    transient::init();
    quiet::init();
    worker::init();
}

// The install and upgrade scripts are written by hand (sql/sqlstreams--*.sql), and the install
// script is what pgrx's own `cargo pgrx install`, `package` and `schema` write: every function
// and trigger here says `sql = false`, so the file below is the whole schema. `scripts/rig test`
// checks that it declares each of them with the signature pgrx derives from the Rust one
// (tests/library_schema.rs writes the library's own declarations from what the library embeds),
// and that the installed script is this version's (so a version bump changes this path too).
pgrx::extension_sql_file!("../sql/sqlstreams--0.2.0.sql", name = "install", bootstrap);

#[cfg(test)]
mod layout {
    //! The shape of the code a maintainer relies on: modules of src/ import each other without
    //! circles, so each can be read knowing only the ones below it; no file of src/ or
    //! client/src is over 700 lines, and no function over 120.

    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// The Rust files under `dir`.
    fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).expect("the source is readable").flatten() {
            let path = entry.path();
            if path.is_dir() {
                files.extend(rust_files(&path));
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
        files
    }

    /// Each top-level module of src/ and the top-level modules its code (not its tests) names.
    fn imports() -> BTreeMap<String, BTreeSet<String>> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let files = rust_files(&src);
        let mut map: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in files {
            let relative = file.strip_prefix(&src).unwrap();
            let top = relative.components().next().unwrap().as_os_str().to_string_lossy();
            let top = top.trim_end_matches(".rs").to_string();
            if top == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            // A file's tests (its `#[cfg(test)] mod` at the end) may import what its code may not.
            let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or_default();
            let names = map.entry(top.clone()).or_default();
            let word =
                |from: &str| -> String { from.chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect() };
            for (at, _) in code.match_indices("crate::") {
                let rest = &code[at + 7..];
                // `use crate::{a, b::c}` names a and b.
                let named: Vec<String> = match rest.strip_prefix('{') {
                    Some(group) => group[..group.find('}').unwrap_or(0)].split(',').map(|i| word(i.trim())).collect(),
                    None => vec![word(rest)],
                };
                names.extend(named.into_iter().filter(|name| !name.is_empty() && *name != top));
            }
        }
        map
    }

    #[test]
    fn no_module_of_src_imports_one_that_imports_it_back() {
        let map = imports();
        // Depth-first, with the path so far: a module met again on its own path closes a circle.
        fn visit(
            map: &BTreeMap<String, BTreeSet<String>>,
            module: &str,
            path: &mut Vec<String>,
            done: &mut BTreeSet<String>,
        ) {
            if let Some(at) = path.iter().position(|m| m == module) {
                panic!("an import circle: {} -> {module}", path[at..].join(" -> "));
            }
            if !done.insert(module.to_string()) {
                return;
            }
            path.push(module.to_string());
            for next in map.get(module).into_iter().flatten().filter(|m| map.contains_key(*m)) {
                visit(map, next, path, done);
            }
            path.pop();
        }
        let mut done = BTreeSet::new();
        for module in map.keys() {
            visit(&map, module, &mut vec![], &mut done);
        }
        assert!(map.contains_key("admin") && map.contains_key("claim"), "the walk found src/'s modules");
    }

    #[test]
    fn the_hot_paths_never_reach_the_operator_api() {
        let map = imports();
        for hot in ["claim", "outcome", "lease", "produce"] {
            let (mut reached, mut next) = (BTreeSet::new(), vec![hot.to_string()]);
            while let Some(module) = next.pop() {
                for m in map.get(&module).into_iter().flatten() {
                    if reached.insert(m.clone()) {
                        next.push(m.clone());
                    }
                }
            }
            assert!(!reached.contains("admin"), "{hot} reaches src/admin/ through its imports");
        }
    }

    #[test]
    fn no_file_is_over_700_lines_and_no_function_over_120() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut long = Vec::new();
        for file in rust_files(&root.join("src")).into_iter().chain(rust_files(&root.join("client/src"))) {
            let text = std::fs::read_to_string(&file).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            let name = file.strip_prefix(root).unwrap().display().to_string();
            if lines.len() > 700 {
                long.push(format!("{name}: {} lines", lines.len()));
            }
            // rustfmt's layout: a function ends at the first `}` at its own indentation.
            for (at, line) in lines.iter().enumerate() {
                let code = line.trim_start();
                let indent = &line[..line.len() - code.len()];
                let words: Vec<&str> = code.split_whitespace().take_while(|w| !w.starts_with("fn")).collect();
                let is_fn = code.split_whitespace().any(|w| w == "fn")
                    && words
                        .iter()
                        .all(|w| ["pub", "pub(crate)", "pub(super)", "async", "unsafe", "const"].contains(w))
                    && !code.ends_with(';');
                if !is_fn {
                    continue;
                }
                let end = lines[at + 1..].iter().position(|l| *l == format!("{indent}}}"));
                if let Some(end) = end.filter(|end| end + 2 > 120) {
                    long.push(format!("{name}:{}: a function of {} lines", at + 1, end + 2));
                }
            }
        }
        assert!(long.is_empty(), "too long: {long:#?}");
    }
}
