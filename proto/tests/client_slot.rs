//! Replication slots against a real PostgreSQL 18: CREATE with each
//! snapshot action, exported snapshot visibility, DROP and its errors.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Auth, PgServer, ROLE, eventually};
use mm_proto::Lsn;
use mm_proto::client::{
    ReplicationClient, SQLSTATE_DUPLICATE_OBJECT, SQLSTATE_UNDEFINED_OBJECT, SnapshotAction,
};

#[tokio::test]
async fn exported_snapshot_sees_exactly_rows_before_the_slot() {
    let server = PgServer::start(Auth::Scram);
    let sql = server.sql().await;
    sql.batch_execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2);")
        .await
        .unwrap();

    let mut client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();
    let slot = client
        .create_logical_slot("mm_snap", "pgoutput", SnapshotAction::Export, false)
        .await
        .unwrap();
    assert_eq!(slot.slot_name, "mm_snap");
    assert_eq!(slot.output_plugin.as_deref(), Some("pgoutput"));
    let snapshot = slot.snapshot_name.clone().unwrap();
    assert!(slot.consistent_point > Lsn::INVALID);

    // The slot starts decoding exactly at the consistent point.
    let row = sql
        .query_one(
            "SELECT plugin, slot_type, temporary, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'mm_snap'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "pgoutput");
    assert_eq!(row.get::<_, String>(1), "logical");
    assert!(!row.get::<_, bool>(2));
    assert_eq!(
        row.get::<_, String>(3).parse::<Lsn>().unwrap(),
        slot.consistent_point
    );

    // Committed after the slot: in the slot's stream, not in the snapshot.
    sql.execute("INSERT INTO t VALUES (3)", &[]).await.unwrap();

    let reader = server.sql().await;
    reader
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '{snapshot}';"
        ))
        .await
        .unwrap();
    let ids: Vec<i32> = reader
        .query("SELECT id FROM t ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, vec![1, 2]);
    reader.batch_execute("COMMIT").await.unwrap();
    let now: i64 = sql
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(now, 3);

    // The snapshot lives only as long as the exporting connection is idle:
    // after it runs another command, importing fails.
    client.identify_system().await.unwrap();
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    let err = reader
        .batch_execute(&format!("SET TRANSACTION SNAPSHOT '{snapshot}'"))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT),
        "{err:?}"
    );
    reader.batch_execute("ROLLBACK").await.unwrap();

    client.drop_slot("mm_snap", false).await.unwrap();
    let left: i64 = sql
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'mm_snap'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

#[tokio::test]
async fn use_snapshot_in_the_replication_session() {
    let server = PgServer::start(Auth::Trust);
    server.psql(&format!(
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (10), (20); GRANT SELECT ON t TO {ROLE}"
    ));
    let mut client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();
    client
        .simple_query("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await
        .unwrap();
    let slot = client
        .create_logical_slot("mm_use", "pgoutput", SnapshotAction::Use, false)
        .await
        .unwrap();
    assert_eq!(slot.snapshot_name, None);
    server.psql("INSERT INTO t VALUES (30)");
    let rows = client
        .simple_query("SELECT sum(id) FROM public.t")
        .await
        .unwrap();
    assert_eq!(
        rows[0].get(0),
        Some("30"),
        "the transaction sees the slot's snapshot"
    );
    client.simple_query("COMMIT").await.unwrap();
    let rows = client
        .simple_query("SELECT sum(id) FROM public.t")
        .await
        .unwrap();
    assert_eq!(rows[0].get(0), Some("60"));
}

#[tokio::test]
async fn temporary_slot_goes_away_with_the_connection() {
    let server = PgServer::start(Auth::Trust);
    let mut client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();
    let slot = client
        .create_logical_slot("mm_temp", "pgoutput", SnapshotAction::NoExport, true)
        .await
        .unwrap();
    assert_eq!(slot.snapshot_name, None);
    assert_eq!(
        server.psql("SELECT temporary FROM pg_replication_slots WHERE slot_name = 'mm_temp'"),
        "t"
    );
    client.close().await;
    let gone = eventually(Duration::from_secs(10), || async {
        (server.psql("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'mm_temp'")
            == "0")
            .then_some(())
    })
    .await;
    assert!(gone.is_some(), "temporary slot outlived its connection");
}

#[tokio::test]
async fn slot_errors_carry_sqlstates() {
    let server = PgServer::start(Auth::Trust);
    let mut client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();

    let err = client.drop_slot("no_such_slot", false).await.unwrap_err();
    assert_eq!(err.code(), Some(SQLSTATE_UNDEFINED_OBJECT), "{err:?}");
    assert!(err.to_string().contains("no_such_slot"), "{err}");
    let err = client.drop_slot("no_such_slot", true).await.unwrap_err();
    assert_eq!(err.code(), Some(SQLSTATE_UNDEFINED_OBJECT), "{err:?}");

    client
        .create_logical_slot("dup", "pgoutput", SnapshotAction::NoExport, false)
        .await
        .unwrap();
    let err = client
        .create_logical_slot("dup", "pgoutput", SnapshotAction::NoExport, false)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(SQLSTATE_DUPLICATE_OBJECT), "{err:?}");

    // A name with a quote is passed as data: the server judges the name
    // (invalid_name), rather than choking on broken syntax (42601).
    let err = client
        .create_logical_slot(
            "bad\"name; DROP",
            "pgoutput",
            SnapshotAction::NoExport,
            false,
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("42602"), "{err:?}");

    let err = client
        .create_logical_slot("nope", "no_such_plugin", SnapshotAction::NoExport, false)
        .await
        .unwrap_err();
    assert!(err.code().is_some(), "{err:?}");
    assert!(err.to_string().contains("no_such_plugin"), "{err}");

    // After all those errors the session is still usable.
    client.drop_slot("dup", true).await.unwrap();
    assert_eq!(
        server.psql("SELECT count(*) FROM pg_replication_slots"),
        "0"
    );
}
