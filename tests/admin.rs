//! The Rust client's typed admin calls (`Client::admin`) against the throwaway cluster: every
//! operation and inspection function, each checked against what it did.

use std::time::Duration;

use sqlstreams_client::{Client, Concurrency, Error, GroupChanges, OnDead, Privilege, SeekTo, StreamChanges};
use sqlstreams_tests::*;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

#[test]
fn an_operator_inspects_and_repairs_a_group_through_the_client() {
    let mut c = connect();
    let s = Stream::create(&mut c, "admin");
    let g = s.group(&mut c, "billing", Some("ordered"));
    let mut produced: Vec<i64> = (0..4).map(|i| s.produce(&mut c, json!({"n": i}), Some("acct-1"))).collect();
    produced.push(s.produce(&mut c, json!({"n": 4}), Some("acct-2")));
    let client = Client::connect(&database_url()).unwrap();
    let admin = client.admin();

    let hold = GroupChanges {
        on_dead: Some(OnDead::Hold),
        max_retries: Some(5),
        max_inflight: Some(50),
        ..Default::default()
    };
    assert!(block_on(admin.alter_group(&s.name, "billing", hold)).unwrap());
    let first = g.claim(&mut c, 10);
    let find = |ds: &[Delivery], id: i64| ds.iter().find(|d| d.message_id == id).cloned().expect("claimed");
    g.ack(&mut c, &find(&first, produced[0]));
    let second = g.claim(&mut c, 10);
    g.fail(&mut c, &find(&second, produced[1]), "boom", true, None);
    let all: Vec<Delivery> = first.iter().chain(&second).cloned().collect();
    let open = find(&all, produced[4]);

    // Inspection.
    let streams = block_on(admin.streams()).unwrap();
    let info = streams.iter().find(|i| i.name == s.name).expect("the stream is listed");
    assert_eq!((info.id, info.head, info.max_bytes), (s.id, 5, None));
    let groups = block_on(admin.groups(Some(&s.name))).unwrap();
    assert_eq!(groups.len(), 1);
    let group = &groups[0];
    assert_eq!((group.name.as_str(), group.concurrency_override), ("billing", Some(Concurrency::Ordered)));
    assert_eq!((group.max_retries, group.on_dead.as_str(), group.paused), (5, "hold", false));
    assert_eq!(group.max_inflight, Some(50));
    let status = block_on(admin.group_status(&s.name, "billing")).unwrap();
    assert_eq!(status, group.status, "the view and the function agree");
    assert_eq!((status.head, status.dead, status.lag), (5, 1, 5 - status.committed));
    assert!(status.committed >= produced[0] && status.committed < produced[2], "{status:?}");
    assert!(status.oldest_unresolved_at.is_some());

    let dead = block_on(admin.dead_messages(&s.name, "billing")).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].message_id, dead[0].last_error.as_deref()), (produced[1], Some("boom")));
    assert_eq!(dead[0].payload, Some(json!({"n": 1})));
    let blocked = block_on(admin.blocked_keys(&s.name, "billing")).unwrap();
    assert_eq!(blocked.len(), 1, "the held key: {blocked:?}");
    assert_eq!((blocked[0].message_key.as_deref(), blocked[0].oldest_message_id), (Some("acct-1"), produced[1]));
    assert_eq!((blocked[0].status.as_str(), blocked[0].waiting_behind), ("dead", 2));

    let leases = block_on(admin.open_leases(&s.name, "billing")).unwrap();
    assert!(leases.iter().any(|l| l.kind == "range" && l.lease_token == open.lease_token), "{leases:?}");
    assert!(block_on(admin.next_due(&s.name, "billing")).unwrap().is_some(), "the lease expires");
    let peeked = block_on(admin.peek(&s.name, 0, 10)).unwrap();
    assert_eq!(peeked.iter().map(|m| m.message_id).collect::<Vec<_>>(), produced);
    assert_eq!(peeked[2].payload, json!({"n": 2}));

    let mut producer = connect();
    let mut tx = producer.transaction().unwrap();
    s.produce(&mut tx, json!({}), Some("acct-2"));
    let holders = block_on(admin.fence_holders(Some(&s.name))).unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert!(holders[0].pid.is_some() && holders[0].xact_start.is_some());
    tx.rollback().unwrap();
    assert!(block_on(admin.fence_holders(Some(&s.name))).unwrap().is_empty());

    // Operations.
    assert!(block_on(admin.break_lease(&s.name, "billing", open.lease_token)).unwrap());
    assert_eq!(block_on(admin.redrive(&s.name, "billing", None)).unwrap(), [produced[1]]);
    assert!(block_on(admin.dead_messages(&s.name, "billing")).unwrap().is_empty());
    let again = g.claim(&mut c, 10);
    let key_one: Vec<i64> =
        again.iter().filter(|d| d.message_key.as_deref() == Some("acct-1")).map(|d| d.message_id).collect();
    assert_eq!(key_one[0], produced[1], "the redriven message runs first, in order: {again:?}");
    g.fail(&mut c, &find(&again, produced[1]), "boom again", true, None);
    assert!(find(&again, produced[4]).attempt > open.attempt, "the broken lease's message was taken over");
    assert!(!block_on(admin.break_lease(&s.name, "billing", open.lease_token)).unwrap(), "taken over: nothing left");
    assert!(block_on(admin.skip(&s.name, "billing", produced[1])).unwrap());
    assert!(!block_on(admin.skip(&s.name, "billing", produced[1])).unwrap(), "skipped already");
    assert_eq!(block_on(admin.purge_dead(&s.name, "billing", Duration::ZERO)).unwrap(), 0);

    assert!(block_on(admin.pause_group(&s.name, "billing")).unwrap());
    assert!(!block_on(admin.pause_group(&s.name, "billing")).unwrap(), "paused already");
    assert!(block_on(admin.groups(Some(&s.name))).unwrap()[0].paused);
    assert!(block_on(admin.resume_group(&s.name, "billing")).unwrap());
    assert_eq!(block_on(admin.seek(&s.name, "billing", SeekTo::Id(produced[2]))).unwrap(), produced[2]);
    assert_eq!(block_on(admin.group_status(&s.name, "billing")).unwrap().committed, produced[2]);
    let after: Vec<i64> = ids(&g.claim(&mut c, 10));
    assert!(
        after.contains(&produced[3]) && !after.contains(&produced[2]),
        "after the seek, the messages after P: {after:?}"
    );

    let bounded = StreamChanges {
        max_bytes: Some(50_000_000),
        dead_retention: Some(Duration::from_secs(3600)),
        ..Default::default()
    };
    assert!(block_on(admin.alter_stream(&s.name, bounded)).unwrap());
    let info = block_on(admin.streams()).unwrap().into_iter().find(|i| i.name == s.name).unwrap();
    assert_eq!((info.max_bytes, info.dead_retention), (Some(50_000_000), Duration::from_secs(3600)));

    let reader = role(&mut c, "reader", "IN ROLE sqlstreams_consumer");
    assert!(block_on(admin.grant(&s.name, &reader, Privilege::Consume, Some("billing"))).unwrap());
    assert!(!block_on(admin.grant(&s.name, &reader, Privilege::Consume, Some("billing"))).unwrap());
    assert!(block_on(admin.revoke(&s.name, &reader, Privilege::Consume, Some("billing"))).unwrap());

    let later = std::time::SystemTime::now() + Duration::from_secs(3600);
    assert_eq!(
        block_on(admin.seek(&s.name, "billing", SeekTo::Time(later))).unwrap(),
        produced[4],
        "the last message before then"
    );

    let reports = block_on(admin.maintain_stream(&s.name)).unwrap();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].stream, s.name);

    // Refusals map to the client's errors; nothing changed.
    let unknown = block_on(admin.group_status(&s.name, "nobody")).unwrap_err();
    assert!(matches!(unknown, Error::UnknownObject { .. }), "{unknown:?}");
    let config = sqlstreams_client::ClientOptions { pool_size: 1, ..Default::default() };
    let url = format!("postgres://{reader}@{}", database_url().split_once('@').unwrap().1);
    let refused = block_on(Client::connect_with(&url, config).unwrap().admin().drop_stream(&s.name)).unwrap_err();
    assert!(matches!(refused, Error::PermissionDenied { .. }), "{refused:?}");
    assert!(block_on(admin.streams()).unwrap().iter().any(|i| i.name == s.name), "the refused drop changed nothing");
    assert!(block_on(admin.drop_group(&s.name, "billing")).unwrap());
    assert!(block_on(admin.drop_stream(&s.name)).unwrap());
    assert!(!block_on(admin.drop_stream(&s.name)).unwrap(), "dropped already");
}
