//! START_REPLICATION with pgoutput against a real PostgreSQL 18: data,
//! status updates, keepalives, confirmed positions, cancel safety, errors.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Auth, PgServer, eventually};
use futures_util::FutureExt;
use mm_proto::Lsn;
use mm_proto::client::{
    ClientError, LogicalReplicationStream, ReplicationClient, SQLSTATE_OBJECT_IN_USE,
    SQLSTATE_UNDEFINED_OBJECT, SnapshotAction,
};
use mm_proto::walsender::{ServerMessage, StandbyStatusUpdate, pg_now_micros};

const OPTIONS: &[(&str, &str)] = &[
    ("proto_version", "4"),
    ("publication_names", "\"mm\""),
    ("origin", "none"),
    ("streaming", "on"),
    ("messages", "true"),
];

fn setup(server: &PgServer) {
    server.psql("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION mm FOR TABLE t");
}

async fn start(server: &PgServer, slot: &str, create: bool) -> LogicalReplicationStream {
    let mut client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();
    if create {
        client
            .create_logical_slot(slot, "pgoutput", SnapshotAction::NoExport, false)
            .await
            .unwrap();
    }
    client
        .start_logical_replication(slot, Lsn::INVALID, OPTIONS)
        .await
        .unwrap()
}

async fn recv(stream: &mut LogicalReplicationStream) -> ServerMessage {
    tokio::time::timeout(Duration::from_secs(30), stream.next())
        .await
        .expect("no message within 30s")
        .expect("stream ended")
        .unwrap()
}

/// The pgoutput payloads of the next transaction, Begin through Commit,
/// skipping keepalives.
async fn next_transaction(stream: &mut LogicalReplicationStream) -> Vec<Bytes> {
    let mut out: Vec<Bytes> = Vec::new();
    while out.last().is_none_or(|d| d[0] != b'C') {
        if let ServerMessage::XLogData { data, .. } = recv(stream).await {
            out.push(data);
        }
    }
    out
}

/// pgoutput Commit: 'C', flags, commit_lsn, end_lsn, timestamp.
fn commit_end_lsn(commit: &[u8]) -> Lsn {
    assert_eq!(commit[0], b'C');
    Lsn(u64::from_be_bytes(commit[10..18].try_into().unwrap()))
}

/// The first column of a pgoutput Insert (no xid: not a streamed transaction):
/// 'I', relid, 'N', ncols, then 't' + length + text.
fn insert_first_value(insert: &[u8]) -> String {
    assert_eq!(insert[0], b'I');
    assert_eq!(insert[5], b'N');
    assert_eq!(insert[8], b't');
    let len = u32::from_be_bytes(insert[9..13].try_into().unwrap()) as usize;
    String::from_utf8(insert[13..13 + len].to_vec()).unwrap()
}

fn tags(txn: &[Bytes]) -> Vec<u8> {
    txn.iter().map(|d| d[0]).collect()
}

#[tokio::test]
async fn stream_status_keepalive_and_confirmed_flush() {
    let server = PgServer::start(Auth::Scram);
    setup(&server);
    let mut stream = start(&server, "mm_stream", true).await;
    let pid = stream.backend_pid().unwrap();

    server.psql("INSERT INTO t VALUES (1, 'one')");
    let txn = next_transaction(&mut stream).await;
    assert_eq!(tags(&txn), b"BRIC");
    assert_eq!(insert_first_value(&txn[2]), "1");
    let end = commit_end_lsn(&txn[3]);
    assert!(end > Lsn::INVALID);

    // Report the commit as flushed and ask for an immediate reply.
    stream
        .send_status(&StandbyStatusUpdate {
            write: end,
            flush: end,
            apply: end,
            send_time: pg_now_micros(),
            reply_requested: true,
        })
        .await
        .unwrap();
    let keepalive = loop {
        if let m @ ServerMessage::PrimaryKeepalive { .. } = recv(&mut stream).await {
            break m;
        }
    };
    match keepalive {
        ServerMessage::PrimaryKeepalive {
            wal_end, send_time, ..
        } => {
            assert!(wal_end >= end, "{wal_end} < {end}");
            assert!((pg_now_micros() - send_time).abs() < 60_000_000);
        }
        _ => unreachable!(),
    }

    // The walsender recorded our flush position in the slot and in its stats.
    let confirmed = eventually(Duration::from_secs(10), || async {
        let v = server.psql(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'mm_stream'",
        );
        (v.parse::<Lsn>().ok() == Some(end)).then_some(())
    })
    .await;
    assert!(
        confirmed.is_some(),
        "confirmed_flush_lsn never reached {end}"
    );
    assert_eq!(
        server.psql(&format!(
            "SELECT flush_lsn FROM pg_stat_replication WHERE pid = {pid}"
        )),
        end.to_string()
    );

    // End cleanly; the connection is reusable for commands afterwards, but
    // not for a second stream (a PostgreSQL walsender limitation).
    let mut client = stream.finish().await.unwrap();
    client.identify_system().await.unwrap();
    let err = client
        .start_logical_replication("mm_stream", Lsn::INVALID, OPTIONS)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Protocol(_)), "{err:?}");

    // Restarting from 0/0 resumes after the confirmed commit: row 1 is not resent.
    let mut stream = start(&server, "mm_stream", false).await;
    server.psql("INSERT INTO t VALUES (2, 'two')");
    let txn = next_transaction(&mut stream).await;
    assert_eq!(tags(&txn), b"BRIC");
    assert_eq!(insert_first_value(&txn[2]), "2");

    let mut client = stream.finish().await.unwrap();
    client.drop_slot("mm_stream", true).await.unwrap();
    assert_eq!(
        server.psql("SELECT count(*) FROM pg_replication_slots"),
        "0"
    );
}

/// Every pending `next` is dropped after a single poll (as when a timer
/// wins a `select!`), while the data is still arriving, often mid-frame.
/// Nothing may be lost or garbled.
#[tokio::test]
async fn next_is_cancel_safe() {
    let server = PgServer::start(Auth::Trust);
    setup(&server);
    let mut stream = start(&server, "mm_cancel", true).await;
    let sql = server.sql().await;
    let insert = tokio::spawn(async move {
        sql.batch_execute(
            "INSERT INTO t SELECT g, repeat(chr(65 + g % 26), 5000) FROM generate_series(1, 300) g",
        )
        .await
        .unwrap();
    });

    let mut cancelled = 0u32;
    let mut txn: Vec<Bytes> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while txn.last().is_none_or(|d| d[0] != b'C') {
        assert!(
            tokio::time::Instant::now() < deadline,
            "transaction not received"
        );
        match stream.next().now_or_never() {
            None => {
                cancelled += 1;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Some(m) => {
                if let ServerMessage::XLogData { data, .. } = m.unwrap().unwrap() {
                    txn.push(data);
                }
            }
        }
    }
    insert.await.unwrap();
    assert!(cancelled > 0, "the test never cancelled a pending next()");
    assert_eq!(txn.len(), 1 + 1 + 300 + 1);
    assert_eq!(txn[0][0], b'B');
    assert_eq!(txn[1][0], b'R');
    for (i, insert) in txn[2..302].iter().enumerate() {
        let id = i + 1;
        assert_eq!(insert_first_value(insert), id.to_string());
        // The 5000-character value survives intact at the end of the message.
        let letter = b'A' + (id % 26) as u8;
        assert!(insert.ends_with(&vec![letter; 5000]), "row {id} garbled");
    }
    eprintln!("cancelled {cancelled} pending next() calls");
}

#[tokio::test]
async fn replication_errors() {
    let server = PgServer::start(Auth::Trust);
    setup(&server);

    // Missing slot.
    let client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();
    let err = client
        .start_logical_replication("no_such_slot", Lsn::INVALID, OPTIONS)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(SQLSTATE_UNDEFINED_OBJECT), "{err:?}");

    // Option values are literals: a quote inside reaches pgoutput as data
    // (invalid value, 22023), not as broken command syntax (42601).
    let mut client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();
    client
        .create_logical_slot("mm_err", "pgoutput", SnapshotAction::NoExport, false)
        .await
        .unwrap();
    let err = client
        .start_logical_replication("mm_err", Lsn::INVALID, &[("proto_version", "4'); x")])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("22023"), "{err:?}");
    // The walsender reports that error before its error cleanup releases
    // the slot: wait for the release, or the next start finds it in use.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while server
        .psql("SELECT active FROM pg_replication_slots WHERE slot_name = 'mm_err'")
        .trim()
        != "f"
    {
        assert!(
            std::time::Instant::now() < deadline,
            "slot mm_err never released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A slot streams to one walsender at a time.
    let mut first = start(&server, "mm_err", false).await;
    let second = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();
    let err = second
        .start_logical_replication("mm_err", Lsn::INVALID, OPTIONS)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(SQLSTATE_OBJECT_IN_USE), "{err:?}");

    // The walsender is killed: next() reports the FATAL, then the stream ends.
    let pid = first.backend_pid().unwrap();
    server.psql(&format!("SELECT pg_terminate_backend({pid})"));
    let err = loop {
        match tokio::time::timeout(Duration::from_secs(30), first.next())
            .await
            .unwrap()
        {
            Some(Ok(_)) => continue,
            Some(Err(e)) => break e,
            None => panic!("stream ended without an error"),
        }
    };
    match &err {
        ClientError::Server { severity, code, .. } => {
            assert_eq!(severity, "FATAL");
            assert_eq!(code, "57P01");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.is_fatal());
    assert!(first.next().await.is_none());
    assert!(
        first
            .send_status(&StandbyStatusUpdate::all(Lsn(1)))
            .await
            .is_err()
    );
}
