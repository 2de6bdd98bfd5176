//! DROP EXTENSION sqlstreams while streams exist (src/drop_guard.rs): refused, with CASCADE too
//! and through DROP SCHEMA, with 2BP01 and a hint, changing nothing; once the streams are
//! dropped, the extension drops and leaves nothing behind. In a database of its own.

use postgres::Client;
use sqlstreams_tests::*;

/// Relations in the sqlstreams schema, and the catalog's rows.
fn footprint(c: &mut Client) -> (i64, i64, i64) {
    let row = c
        .query_one(
            "SELECT (SELECT count(*) FROM pg_class WHERE relnamespace = 'sqlstreams'::regnamespace),
                    (SELECT count(*) FROM sqlstreams.stream), (SELECT count(*) FROM sqlstreams.consumer_group)",
            &[],
        )
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

#[test]
fn dropping_the_extension_with_streams_is_refused_and_without_them_leaves_nothing() {
    let (mut c, _) = own_database("dropext");
    let s = Stream::create(&mut c, "kept");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 5, None);
    let before = footprint(&mut c);
    for drop in [
        "DROP EXTENSION sqlstreams",
        "DROP EXTENSION sqlstreams CASCADE",
        "DROP EXTENSION IF EXISTS no_such_extension, sqlstreams CASCADE",
        "DROP SCHEMA sqlstreams CASCADE",
    ] {
        let err = c.batch_execute(drop).expect_err(drop);
        assert_eq!(sqlstate(&err), "2BP01", "{drop}: {err}");
        let db = err.as_db_error().unwrap();
        assert!(db.message().contains("1 stream"), "{drop}: {}", db.message());
        assert!(db.hint().is_some_and(|h| h.contains("sqlstreams.drop_stream")), "{drop}: the hint says how");
        assert_eq!(footprint(&mut c), before, "{drop}: a refused drop changes nothing");
    }
    assert_eq!(g.claim(&mut c, 10).len(), 5, "the stream works on");

    // Other drops pass through.
    c.batch_execute("CREATE SCHEMA unrelated; DROP SCHEMA unrelated; DROP EXTENSION IF EXISTS no_such_extension")
        .unwrap();

    c.query_one("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap();
    c.batch_execute("DROP EXTENSION sqlstreams").unwrap();
    let left: i64 = c
        .query_one("SELECT count(*) FROM pg_class WHERE relname ~ '^(message_log|cursor|lane|exception)_'", &[])
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "nothing of the stream is left behind");
    c.batch_execute("CREATE EXTENSION sqlstreams").unwrap();
}
