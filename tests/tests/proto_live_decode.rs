//! mm-proto's replication client and pgoutput decoder against a real
//! PostgreSQL 18: every kind of change a workload produces must decode to
//! exactly the messages, values and positions the server generated.

#![allow(clippy::unwrap_used)] // tests may unwrap (project rule)

use std::time::Duration;

use mm_proto::Lsn;
use mm_proto::client::{ReplicationClient, ReplicationConfig, SnapshotAction};
use mm_proto::pgoutput::{ColumnValue, Message, PgTimestamp};
use mm_tests::wal::{
    MM_OPTIONS, Received, Renderer, WalStream, confirmed_flush, current_xid, run_txn,
};
use mm_tests::{PgNode, PgOptions};
use tokio_postgres::Client;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Rows in the transaction that must be streamed (~1.7 MB of changes, far
/// over the 64kB logical_decoding_work_mem).
const BIG_ROWS: usize = 5000;

const SCHEMA: &str = "
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE t_basic (id int PRIMARY KEY, name text, n numeric(12,2), j jsonb, b bytea,
                      arr int[], ts timestamptz, m mood);
CREATE TABLE t_full (id int, v text);
ALTER TABLE t_full REPLICA IDENTITY FULL;
CREATE TABLE t_idx (id int PRIMARY KEY, code text NOT NULL, v text);
CREATE UNIQUE INDEX t_idx_code ON t_idx (code);
ALTER TABLE t_idx REPLICA IDENTITY USING INDEX t_idx_code;
CREATE TABLE t_toast (id int PRIMARY KEY, big text, small int);
-- Out of line and uncompressed, so 10 kB really is TOASTed.
ALTER TABLE t_toast ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE t_parent (id int PRIMARY KEY);
CREATE TABLE t_child (id serial PRIMARY KEY, pid int REFERENCES t_parent);
CREATE TABLE t_sp (id int PRIMARY KEY, v text);
CREATE TABLE t_big (id int PRIMARY KEY, pad text);
CREATE PUBLICATION mm FOR ALL TABLES;
";

/// Autovacuum off: its pg_class updates invalidate relcache entries, after
/// which pgoutput re-sends RELATION messages at unpredictable points.
fn node_options() -> PgOptions {
    PgOptions::default()
        .conf("logical_decoding_work_mem", "64kB")
        .conf("autovacuum", "off")
        .conf("max_prepared_transactions", "4")
}

fn repl_config(node: &PgNode) -> ReplicationConfig {
    ReplicationConfig::from_dsn(&node.dsn())
        .unwrap()
        .with_portable_text_settings()
}

async fn create_slot(node: &PgNode, slot: &str) -> Lsn {
    let mut client = ReplicationClient::connect(&repl_config(node))
        .await
        .unwrap();
    let created = client
        .create_logical_slot(slot, "pgoutput", SnapshotAction::NoExport, false)
        .await
        .unwrap();
    assert_eq!(created.slot_name, slot);
    client.close().await;
    created.consistent_point
}

/// The commit timestamp PostgreSQL recorded for `xid` (track_commit_timestamp
/// is on in the harness), in pgoutput's representation.
async fn commit_ts(c: &Client, xid: u32) -> PgTimestamp {
    let row = c
        .query_one(
            "SELECT ((extract(epoch FROM pg_xact_commit_timestamp($1::text::xid)) - 946684800)
                     * 1000000)::bigint",
            &[&xid.to_string()],
        )
        .await
        .unwrap();
    PgTimestamp(row.get(0))
}

fn msgs(received: &[Received]) -> Vec<&Message> {
    received.iter().map(|r| &r.msg).collect()
}

fn text(v: &ColumnValue) -> &str {
    match v {
        ColumnValue::Text(b) => std::str::from_utf8(b).unwrap(),
        other => panic!("expected a text value, got {other:?}"),
    }
}

/// Checks every BEGIN..COMMIT pair in `received` (outside stream blocks):
/// the xids are `xids` in order, BEGIN's final LSN is the COMMIT's LSN, the
/// timestamps are the server's commit timestamps, and commits advance.
async fn check_transactions(c: &Client, received: &[Received], xids: &[u32]) -> Vec<Lsn> {
    let mut found = Vec::new();
    let mut open = None;
    for r in received {
        match &r.msg {
            Message::Begin(b) => {
                assert!(open.is_none(), "BEGIN inside a transaction");
                open = Some(b.clone());
            }
            Message::Commit(commit) => {
                let b = open.take().expect("COMMIT without BEGIN");
                assert_eq!(b.final_lsn, commit.commit_lsn, "xid {}", b.xid);
                assert_eq!(b.commit_timestamp, commit.commit_timestamp);
                assert!(commit.commit_lsn < commit.end_lsn);
                assert_eq!(
                    commit.commit_timestamp,
                    commit_ts(c, b.xid).await,
                    "commit timestamp of xid {}",
                    b.xid
                );
                found.push((b.xid, commit.clone()));
            }
            _ => {}
        }
    }
    assert!(open.is_none(), "unterminated transaction");
    assert_eq!(found.iter().map(|(x, _)| *x).collect::<Vec<_>>(), xids);
    for pair in found.windows(2) {
        assert!(pair[0].1.end_lsn <= pair[1].1.commit_lsn);
    }
    found.iter().map(|(_, c)| c.end_lsn).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgoutput_v4_decodes_every_kind_of_change_exactly() {
    mm_tests::init_tracing();
    let node = PgNode::start_with("decode", node_options()).unwrap();
    node.execute(SCHEMA).await.unwrap();
    let consistent_point = create_slot(&node, "s_main").await;
    let c = node.connect().await.unwrap();

    // ---- the workload, one transaction at a time ----
    let x_insert = run_txn(
        &c,
        r#"INSERT INTO t_basic VALUES
             (1, 'alpha', 12345.67, '{"b": [1, 2], "a": null}', '\xdeadbeef', '{1,2,NULL,4}',
              '2024-02-29 23:59:59.123456+05:30', 'happy'),
             (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
             (3, 'it''s "quoted"', -0.5, '"str"', '\x', '{}', 'infinity', 'sad')"#,
    )
    .await
    .unwrap();
    let x_update = run_txn(
        &c,
        "UPDATE t_basic SET name = 'beta', m = 'ok' WHERE id = 1",
    )
    .await
    .unwrap();
    let x_update_key = run_txn(&c, "UPDATE t_basic SET id = 10 WHERE id = 2")
        .await
        .unwrap();
    let x_delete = run_txn(&c, "DELETE FROM t_basic WHERE id = 3")
        .await
        .unwrap();
    let x_full = run_txn(
        &c,
        "INSERT INTO t_full VALUES (1, 'one'), (2, NULL);
         UPDATE t_full SET v = 'uno' WHERE id = 1;
         DELETE FROM t_full WHERE id = 2;",
    )
    .await
    .unwrap();
    let x_idx = run_txn(
        &c,
        "INSERT INTO t_idx VALUES (1, 'c1', 'x');
         UPDATE t_idx SET v = 'y' WHERE id = 1;
         UPDATE t_idx SET code = 'c2' WHERE id = 1;
         DELETE FROM t_idx WHERE id = 1;",
    )
    .await
    .unwrap();
    let x_toast = run_txn(
        &c,
        "INSERT INTO t_toast VALUES (1, repeat('x', 10000) || 'END', 1)",
    )
    .await
    .unwrap();
    // The TOASTed value really is stored out of line (else the next check
    // would prove nothing).
    let toast_bytes = node
        .query_one_string(
            "SELECT pg_total_relation_size(reltoastrelid) > 8192 FROM pg_class WHERE relname = 't_toast'",
        )
        .await
        .unwrap();
    assert_eq!(toast_bytes.as_deref(), Some("t"));
    let x_toast_update = run_txn(&c, "UPDATE t_toast SET small = 2 WHERE id = 1")
        .await
        .unwrap();
    let x_fk = run_txn(
        &c,
        "INSERT INTO t_parent VALUES (1); INSERT INTO t_child (pid) VALUES (1);",
    )
    .await
    .unwrap();
    let x_truncate = run_txn(&c, "TRUNCATE t_parent RESTART IDENTITY CASCADE")
        .await
        .unwrap();
    let x_fk_again = run_txn(
        &c,
        "INSERT INTO t_parent VALUES (2); INSERT INTO t_child (pid) VALUES (2);",
    )
    .await
    .unwrap();
    let x_savepoints = run_txn(
        &c,
        "INSERT INTO t_sp VALUES (1, 'kept');
         SAVEPOINT a;
         INSERT INTO t_sp VALUES (2, 'rolled back');
         SAVEPOINT b;
         INSERT INTO t_sp VALUES (3, 'rolled back too');
         ROLLBACK TO SAVEPOINT a;
         SAVEPOINT c;
         INSERT INTO t_sp VALUES (4, 'kept after release');
         RELEASE SAVEPOINT c;",
    )
    .await
    .unwrap();
    // A non-transactional message is sent even though its transaction aborts;
    // the aborted insert is not.
    c.batch_execute(
        "BEGIN;
         INSERT INTO t_sp VALUES (100, 'aborted');
         SELECT pg_logical_emit_message(false, 'mm', 'nontx');
         ROLLBACK;",
    )
    .await
    .unwrap();
    c.batch_execute("BEGIN").await.unwrap();
    let message_lsn: Lsn = c
        .query_one(
            "SELECT pg_logical_emit_message(true, 'mm', 'payload')::text",
            &[],
        )
        .await
        .unwrap()
        .get::<_, String>(0)
        .parse()
        .unwrap();
    let x_message = current_xid(&c).await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    let x_big = run_txn(
        &c,
        &format!(
            "INSERT INTO t_big SELECT g, repeat('p', 200) FROM generate_series(1, {BIG_ROWS}) g"
        ),
    )
    .await
    .unwrap();
    let x_after_big = run_txn(&c, "INSERT INTO t_big VALUES (5001, 'tail')")
        .await
        .unwrap();

    // The server's view of the end state, for the checks below.
    assert_eq!(
        node.query_strings("SELECT id FROM t_sp ORDER BY id")
            .await
            .unwrap(),
        vec![vec![Some("1".to_owned())], vec![Some("4".to_owned())]]
    );

    // ---- decode it all ----
    let mut stream = WalStream::start(&repl_config(&node), "s_main", &MM_OPTIONS)
        .await
        .unwrap();
    let received = stream
        .collect_through_xid(x_after_big, TIMEOUT)
        .await
        .unwrap();

    // Split off the streamed transaction (its block count depends on memory
    // accounting); everything else must match exactly.
    let stream_from = received
        .iter()
        .position(|r| matches!(r.msg, Message::StreamStart(_)))
        .expect("the big transaction was not streamed");
    let stream_to = received
        .iter()
        .position(|r| matches!(r.msg, Message::StreamCommit(_)))
        .expect("no STREAM COMMIT");
    let mut plain: Vec<Received> = received[..stream_from].to_vec();
    plain.extend_from_slice(&received[stream_to + 1..]);
    let streamed = &received[stream_from..=stream_to];

    // Rendered in stream order: the streamed block describes t_big for the
    // transaction after it.
    let mut renderer = Renderer::new();
    let all_rendered = renderer.render_all(msgs(&received));
    let mut rendered = all_rendered[..stream_from].to_vec();
    rendered.extend_from_slice(&all_rendered[stream_to + 1..]);
    let expected: Vec<&str> = vec![
        // inserts, NULLs, and the text form of every type
        "BEGIN",
        "TYPE public.mood",
        "RELATION public.t_basic default [id int4 key, name text, n numeric/786438, j jsonb, \
         b bytea, arr int4[], ts timestamptz, m public.mood]",
        r#"INSERT t_basic ('1', 'alpha', '12345.67', '{"a": null, "b": [1, 2]}', '\xdeadbeef', '{1,2,NULL,4}', '2024-02-29 18:29:59.123456+00', 'happy')"#,
        "INSERT t_basic ('2', NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
        r#"INSERT t_basic ('3', 'it''s "quoted"', '-0.50', '"str"', '\x', '{}', 'infinity', 'sad')"#,
        "COMMIT",
        // update, key unchanged: no old tuple
        "BEGIN",
        r#"UPDATE t_basic ('1', 'beta', '12345.67', '{"a": null, "b": [1, 2]}', '\xdeadbeef', '{1,2,NULL,4}', '2024-02-29 18:29:59.123456+00', 'ok')"#,
        "COMMIT",
        // update changing the key: old key tuple
        "BEGIN",
        "UPDATE t_basic K(id='2') -> ('10', NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
        "COMMIT",
        "BEGIN",
        "DELETE t_basic K(id='3')",
        "COMMIT",
        // REPLICA IDENTITY FULL: whole old rows, every column a key
        "BEGIN",
        "RELATION public.t_full full [id int4 key, v text key]",
        "INSERT t_full ('1', 'one')",
        "INSERT t_full ('2', NULL)",
        "UPDATE t_full O('1', 'one') -> ('1', 'uno')",
        "DELETE t_full O('2', NULL)",
        "COMMIT",
        // REPLICA IDENTITY USING INDEX: the index's column is the key
        "BEGIN",
        "RELATION public.t_idx index [id int4, code text key, v text]",
        "INSERT t_idx ('1', 'c1', 'x')",
        "UPDATE t_idx ('1', 'c1', 'y')",
        "UPDATE t_idx K(code='c1') -> ('1', 'c2', 'y')",
        "DELETE t_idx K(code='c2')",
        "COMMIT",
        // TOAST: the whole value on insert, 'u' when unchanged
        "BEGIN",
        "RELATION public.t_toast default [id int4 key, big text, small int4]",
        "INSERT t_toast ('1', 'xxxxxxxx'..'xxxxxEND'[10003 bytes], '1')",
        "COMMIT",
        "BEGIN",
        "UPDATE t_toast ('1', TOAST, '2')",
        "COMMIT",
        "BEGIN",
        "RELATION public.t_parent default [id int4 key]",
        "INSERT t_parent ('1')",
        "RELATION public.t_child default [id int4 key, pid int4]",
        "INSERT t_child ('1', '1')",
        "COMMIT",
        // TRUNCATE gives both tables new relfilenodes; the relcache
        // invalidations that causes make pgoutput describe both tables again,
        // in the TRUNCATE's own transaction and again in the next one.
        "BEGIN",
        "RELATION public.t_parent default [id int4 key]",
        "RELATION public.t_child default [id int4 key, pid int4]",
        "TRUNCATE cascade restart_identity t_parent, t_child",
        "COMMIT",
        "BEGIN",
        "RELATION public.t_parent default [id int4 key]",
        "INSERT t_parent ('2')",
        "RELATION public.t_child default [id int4 key, pid int4]",
        // RESTART IDENTITY: the serial starts over at 1
        "INSERT t_child ('1', '2')",
        "COMMIT",
        // savepoints: the rolled-back ones' rows are absent
        "BEGIN",
        "RELATION public.t_sp default [id int4 key, v text]",
        "INSERT t_sp ('1', 'kept')",
        "INSERT t_sp ('4', 'kept after release')",
        "COMMIT",
        "MESSAGE non-transactional mm 'nontx'",
        "BEGIN",
        "MESSAGE transactional mm 'payload'",
        "COMMIT",
        // (the streamed transaction was here)
        // after a streamed commit, t_big's schema counts as sent
        "BEGIN",
        "INSERT t_big ('5001', 'tail')",
        "COMMIT",
    ];
    assert_eq!(rendered, expected, "decoded:\n{}", rendered.join("\n"));

    // The streamed transaction sat exactly between the message and the tail.
    assert_eq!(
        &all_rendered[stream_from - 3..stream_from],
        ["BEGIN", "MESSAGE transactional mm 'payload'", "COMMIT"]
    );

    // Positions, xids and timestamps of the ordinary transactions.
    let commit_ends = check_transactions(
        &c,
        &plain,
        &[
            x_insert,
            x_update,
            x_update_key,
            x_delete,
            x_full,
            x_idx,
            x_toast,
            x_toast_update,
            x_fk,
            x_truncate,
            x_fk_again,
            x_savepoints,
            x_message,
            x_after_big,
        ],
    )
    .await;

    // The TOASTed value arrives whole, byte for byte.
    let toasted = plain
        .iter()
        .find_map(|r| match &r.msg {
            Message::Insert(i) if renderer.relation(i.relation_oid).unwrap().name == "t_toast" => {
                Some(i.new.columns[1].clone())
            }
            _ => None,
        })
        .unwrap();
    assert_eq!(text(&toasted), format!("{}END", "x".repeat(10_000)));

    // Both messages carry their own LSN; the transactional one is the
    // position pg_logical_emit_message returned.
    let logical: Vec<_> = plain
        .iter()
        .filter_map(|r| match &r.msg {
            Message::Message(m) => Some(m.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(logical.len(), 2);
    assert!(!logical[0].transactional && logical[0].xid.is_none());
    assert_eq!(logical[0].content.as_ref(), b"nontx");
    assert!(logical[1].transactional);
    assert_eq!(logical[1].lsn, message_lsn);
    assert_eq!(logical[1].prefix, "mm");
    assert_eq!(logical[1].content.as_ref(), b"payload");
    assert!(logical[0].lsn < logical[1].lsn);

    // ---- the streamed transaction ----
    let mut blocks = 0;
    let mut inserted_ids = Vec::new();
    let mut in_block = false;
    for (i, r) in streamed.iter().enumerate() {
        match &r.msg {
            Message::StreamStart(s) => {
                assert!(!in_block, "nested STREAM START");
                assert_eq!(s.xid, x_big);
                assert_eq!(s.first_segment, blocks == 0);
                in_block = true;
                blocks += 1;
            }
            Message::StreamStop => {
                assert!(in_block);
                in_block = false;
            }
            Message::Relation(rel) => {
                // Described inside the first block, before its first row.
                assert_eq!((blocks, i), (1, 1));
                assert_eq!(rel.xid, Some(x_big));
                assert_eq!(rel.name, "t_big");
            }
            Message::Insert(ins) => {
                assert!(in_block);
                assert_eq!(ins.xid, Some(x_big));
                assert_eq!(text(&ins.new.columns[1]), "p".repeat(200));
                inserted_ids.push(text(&ins.new.columns[0]).parse::<usize>().unwrap());
            }
            Message::StreamCommit(sc) => {
                assert_eq!(i, streamed.len() - 1);
                assert!(!in_block, "STREAM COMMIT inside a block");
                assert_eq!(sc.xid, x_big);
                assert!(sc.commit_lsn < sc.end_lsn);
                assert_eq!(sc.commit_timestamp, commit_ts(&c, x_big).await);
                // Committed after the message transaction, before the tail.
                assert!(commit_ends[12] <= sc.commit_lsn);
                assert!(sc.end_lsn <= commit_ends[13]);
            }
            other => panic!("unexpected {} in the streamed transaction", other.name()),
        }
    }
    assert!(
        blocks >= 2,
        "expected the {BIG_ROWS}-row transaction in several blocks, got {blocks}"
    );
    assert_eq!(inserted_ids.len(), BIG_ROWS);
    assert_eq!(inserted_ids, (1..=BIG_ROWS).collect::<Vec<_>>());
    println!(
        "streamed transaction: {blocks} blocks, {} messages",
        streamed.len()
    );

    // ---- status updates move the slot, and only what they confirm ----
    let last_end = *commit_ends.last().unwrap();
    let before = confirmed_flush(&c, "s_main").await.unwrap();
    assert_eq!(before, consistent_point);
    assert!(before < last_end);
    stream.confirm(last_end).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = confirmed_flush(&c, "s_main").await.unwrap();
        if now == last_end {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "confirmed_flush_lsn stayed at {now}, expected {last_end}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A transaction received but not confirmed is sent again after a
    // reconnect; the confirmed ones never are.
    let x_unconfirmed = run_txn(&c, "INSERT INTO t_sp VALUES (5, 'unconfirmed')")
        .await
        .unwrap();
    let live = stream
        .collect_through_xid(x_unconfirmed, TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        renderer.render_all(msgs(&live)),
        ["BEGIN", "INSERT t_sp ('5', 'unconfirmed')", "COMMIT"]
    );
    stream.finish().await.unwrap().close().await;

    let mut again = WalStream::start(&repl_config(&node), "s_main", &MM_OPTIONS)
        .await
        .unwrap();
    let replay = again
        .collect_through_xid(x_unconfirmed, TIMEOUT)
        .await
        .unwrap();
    // A new session: the relation is described again.
    assert_eq!(
        Renderer::new().render_all(msgs(&replay)),
        [
            "BEGIN",
            "RELATION public.t_sp default [id int4 key, v text]",
            "INSERT t_sp ('5', 'unconfirmed')",
            "COMMIT"
        ]
    );
    check_transactions(&c, &replay, &[x_unconfirmed]).await;
    again.finish().await.unwrap().close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_none_skips_changes_applied_under_a_replication_origin() {
    mm_tests::init_tracing();
    let node = PgNode::start_with("origin", node_options()).unwrap();
    node.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION mm FOR ALL TABLES",
    )
    .await
    .unwrap();
    create_slot(&node, "s_none").await;
    create_slot(&node, "s_any").await;
    let c = node.connect().await.unwrap();

    // What an applier does: commit under origin 'x' with the remote commit's
    // LSN and timestamp.
    let applier = node.connect().await.unwrap();
    applier
        .batch_execute(
            "SELECT pg_replication_origin_create('x');
             SELECT pg_replication_origin_session_setup('x');",
        )
        .await
        .unwrap();
    let x_origin = run_txn(
        &applier,
        "SELECT pg_replication_origin_xact_setup('0/ABCDEF', '2001-02-03 04:05:06.789+00');
         INSERT INTO t VALUES (1, 'from origin x');",
    )
    .await
    .unwrap();
    applier
        .batch_execute("SELECT pg_replication_origin_session_reset()")
        .await
        .unwrap();
    let x_local = run_txn(&c, "INSERT INTO t VALUES (2, 'local')")
        .await
        .unwrap();
    // Both rows are committed locally.
    assert_eq!(
        node.query_one_string("SELECT count(*) FROM t")
            .await
            .unwrap(),
        Some("2".to_owned())
    );

    // origin 'none': only the local transaction.
    let mut none = WalStream::start(&repl_config(&node), "s_none", &MM_OPTIONS)
        .await
        .unwrap();
    let got = none.collect_through_xid(x_local, TIMEOUT).await.unwrap();
    assert_eq!(
        Renderer::new().render_all(msgs(&got)),
        [
            "BEGIN",
            "RELATION public.t default [id int4 key, v text]",
            "INSERT t ('2', 'local')",
            "COMMIT"
        ]
    );
    check_transactions(&c, &got, &[x_local]).await;
    none.finish().await.unwrap().close().await;

    // The same slot contents with origin 'any': the origin transaction is
    // there, tagged with its origin, LSN and (origin's) commit timestamp.
    let any_options: Vec<(&str, &str)> = MM_OPTIONS
        .iter()
        .map(|&(k, v)| if k == "origin" { (k, "any") } else { (k, v) })
        .collect();
    let mut any = WalStream::start(&repl_config(&node), "s_any", &any_options)
        .await
        .unwrap();
    let got = any.collect_through_xid(x_local, TIMEOUT).await.unwrap();
    assert_eq!(
        Renderer::new().render_all(msgs(&got)),
        [
            "BEGIN",
            "ORIGIN x",
            "RELATION public.t default [id int4 key, v text]",
            "INSERT t ('1', 'from origin x')",
            "COMMIT",
            "BEGIN",
            "INSERT t ('2', 'local')",
            "COMMIT"
        ]
    );
    check_transactions(&c, &got, &[x_origin, x_local]).await;
    let Message::Origin(origin) = &got[1].msg else {
        unreachable!()
    };
    assert_eq!(origin.commit_lsn, Lsn(0xAB_CDEF));
    let Message::Begin(begin) = &got[0].msg else {
        unreachable!()
    };
    // 2001-02-03 04:05:06.789 UTC in µs since 2000-01-01.
    assert_eq!(begin.commit_timestamp, PgTimestamp(34_488_306_789_000));
    any.finish().await.unwrap().close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_transactions_decode_at_prepare_time() {
    mm_tests::init_tracing();
    let node = PgNode::start_with("twophase", node_options()).unwrap();
    node.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION mm FOR ALL TABLES",
    )
    .await
    .unwrap();
    create_slot(&node, "s_plain").await;
    // Prepared transactions are only decoded at PREPARE time by a slot
    // created for two-phase decoding.
    let mut client = ReplicationClient::connect(&repl_config(&node))
        .await
        .unwrap();
    client
        .simple_query(
            "CREATE_REPLICATION_SLOT \"s_2pc\" LOGICAL \"pgoutput\" (TWO_PHASE true, SNAPSHOT 'nothing')",
        )
        .await
        .unwrap();
    client.close().await;
    assert_eq!(
        node.query_one_string(
            "SELECT two_phase FROM pg_replication_slots WHERE slot_name = 's_2pc'"
        )
        .await
        .unwrap(),
        Some("t".to_owned())
    );
    let c = node.connect().await.unwrap();
    let mut two_phase_options = MM_OPTIONS.to_vec();
    two_phase_options.push(("two_phase", "true"));
    let mut tp = WalStream::start(&repl_config(&node), "s_2pc", &two_phase_options)
        .await
        .unwrap();

    c.batch_execute("BEGIN; INSERT INTO t VALUES (1, 'prepared then committed')")
        .await
        .unwrap();
    let x_g1 = current_xid(&c).await.unwrap();
    c.batch_execute("PREPARE TRANSACTION 'g1'").await.unwrap();
    let prepared = tp
        .collect_until(TIMEOUT, |m| matches!(m, Message::Prepare(_)))
        .await
        .unwrap();
    let mut renderer = Renderer::new();
    assert_eq!(
        renderer.render_all(msgs(&prepared)),
        [
            "BEGIN PREPARE g1",
            "RELATION public.t default [id int4 key, v text]",
            "INSERT t ('1', 'prepared then committed')",
            "PREPARE g1"
        ]
    );
    // Decoded while the transaction is still only prepared.
    assert_eq!(
        node.query_one_string("SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'g1'")
            .await
            .unwrap(),
        Some("1".to_owned())
    );
    assert_eq!(
        node.query_one_string("SELECT count(*) FROM t")
            .await
            .unwrap(),
        Some("0".to_owned())
    );
    let (Message::BeginPrepare(bp), Message::Prepare(p)) = (&prepared[0].msg, &prepared[3].msg)
    else {
        unreachable!()
    };
    assert_eq!((bp.xid, p.xid), (x_g1, x_g1));
    assert_eq!(bp.prepare_lsn, p.prepare_lsn);
    assert_eq!(bp.end_lsn, p.end_lsn);
    assert_eq!(bp.prepare_timestamp, p.prepare_timestamp);
    assert!(p.prepare_lsn < p.end_lsn);

    c.batch_execute("COMMIT PREPARED 'g1'").await.unwrap();
    let committed = tp.collect_through_xid(x_g1, TIMEOUT).await.unwrap();
    assert_eq!(
        renderer.render_all(msgs(&committed)),
        ["COMMIT PREPARED g1"]
    );
    let Message::CommitPrepared(cp) = &committed[0].msg else {
        unreachable!()
    };
    assert_eq!(cp.xid, x_g1);
    assert!(p.end_lsn <= cp.commit_lsn && cp.commit_lsn < cp.end_lsn);
    assert_eq!(cp.commit_timestamp, commit_ts(&c, x_g1).await);

    c.batch_execute("BEGIN; INSERT INTO t VALUES (2, 'prepared then rolled back')")
        .await
        .unwrap();
    let x_g2 = current_xid(&c).await.unwrap();
    c.batch_execute("PREPARE TRANSACTION 'g2'").await.unwrap();
    c.batch_execute("ROLLBACK PREPARED 'g2'").await.unwrap();
    let x_plain = run_txn(&c, "INSERT INTO t VALUES (3, 'plain')")
        .await
        .unwrap();
    let rest = tp.collect_through_xid(x_plain, TIMEOUT).await.unwrap();
    assert_eq!(
        renderer.render_all(msgs(&rest)),
        [
            "BEGIN PREPARE g2",
            "INSERT t ('2', 'prepared then rolled back')",
            "PREPARE g2",
            "ROLLBACK PREPARED g2",
            "BEGIN",
            "INSERT t ('3', 'plain')",
            "COMMIT"
        ]
    );
    let (Message::Prepare(p2), Message::RollbackPrepared(rp)) = (&rest[2].msg, &rest[3].msg) else {
        unreachable!()
    };
    assert_eq!((p2.xid, rp.xid), (x_g2, x_g2));
    assert_eq!(rp.prepare_end_lsn, p2.end_lsn);
    assert_eq!(rp.prepare_timestamp, p2.prepare_timestamp);
    assert!(rp.prepare_end_lsn < rp.rollback_end_lsn);
    check_transactions(&c, &rest, &[x_plain]).await;
    tp.finish().await.unwrap().close().await;

    // A slot without two-phase decoding sees g1 as an ordinary transaction
    // at COMMIT PREPARED, and g2 not at all.
    let mut plain = WalStream::start(&repl_config(&node), "s_plain", &MM_OPTIONS)
        .await
        .unwrap();
    let got = plain.collect_through_xid(x_plain, TIMEOUT).await.unwrap();
    assert_eq!(
        Renderer::new().render_all(msgs(&got)),
        [
            "BEGIN",
            "RELATION public.t default [id int4 key, v text]",
            "INSERT t ('1', 'prepared then committed')",
            "COMMIT",
            "BEGIN",
            "INSERT t ('3', 'plain')",
            "COMMIT"
        ]
    );
    check_transactions(&c, &got, &[x_g1, x_plain]).await;
    plain.finish().await.unwrap().close().await;
}
