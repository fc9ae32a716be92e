//! End-to-end conflict detection and resolution (SPEC §5-§7, DESIGN.md
//! "Conflicts"), deterministic: the streams between the writers are paused
//! (`mmctl pause`), the conflicting changes are committed on each side one
//! after the other (so their commit timestamps are ordered and known), the
//! streams are resumed, and after `wait-sync` every test checks
//!
//! * the exact rows on every node, and
//! * the exact `mm.conflict_log` rows on every node: type, relation, key,
//!   local/remote origin (node names), local/remote commit timestamps (equal
//!   to `pg_xact_commit_timestamp` of the writes that made them) and the
//!   resolution; `remote_lsn` must lie inside the WAL range the remote
//!   transaction was written in.
//!
//! In every two-node scenario node 0 is "A" and node 1 is "B"; names are
//! chosen so that A < B.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use mm_tests::TestCluster;
use mm_tests::cluster::ClusterOptions;

const T_SCHEMA: &str = "CREATE TABLE t (id int PRIMARY KEY, v text);";
const DUMP_T: &str = "SELECT id, v FROM t ORDER BY id";

/// Time given to the agents to publish their watermarks (what makes a later
/// change on another node *routine* rather than a conflict) before a test
/// writes on top of a row it just received.
const WATERMARK_SETTLE: Duration = Duration::from_millis(2500);

// ---------------------------------------------------------------------------
// Writes with known commit timestamp and WAL range.

/// One committed local transaction: which node, its commit timestamp (as
/// `ts_sql` formats it) and the WAL range its commit lies in.
#[derive(Debug, Clone)]
struct W {
    node: String,
    ts: String,
    lsn_lo: u64,
    lsn_hi: u64,
}

/// Timestamps as fixed-width UTC text: compares exactly, sorts in time order.
fn ts_sql(expr: &str) -> String {
    format!("to_char(({expr}) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')")
}

fn parse_lsn(s: &str) -> Result<u64> {
    let (hi, lo) = s
        .trim()
        .split_once('/')
        .with_context(|| format!("not an LSN: {s:?}"))?;
    Ok((u64::from_str_radix(hi, 16)? << 32) | u64::from_str_radix(lo, 16)?)
}

fn fmt_lsn(l: u64) -> String {
    format!("{:X}/{:X}", l >> 32, l & 0xffff_ffff)
}

async fn one_value(client: &tokio_postgres::Client, sql: &str) -> Result<String> {
    for m in client.simple_query(sql).await? {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            return r
                .get(0)
                .map(str::to_owned)
                .with_context(|| format!("NULL from {sql}"));
        }
    }
    bail!("no row from {sql}")
}

/// Commits `sql` as one transaction on node `i` and returns its facts. Sleeps
/// a little afterwards so that the next write anywhere gets a later commit
/// timestamp.
/// Sessions waiting on another transaction's row or key, on one node: how
/// the race tests see an apply block on a session they hold open.
const ROW_WAITS: &str =
    "SELECT count(*)::text FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'";

/// A session on node `i` inside a transaction that ran `sql` and stays open
/// (its locks held) until the caller commits it.
async fn hold_open(c: &TestCluster, i: usize, sql: &str) -> Result<tokio_postgres::Client> {
    let client = c.pg[i].connect().await?;
    client.batch_execute(&format!("BEGIN; {sql}")).await?;
    Ok(client)
}

/// Polls `sql` until it returns `want` or `limit` passes; whether it did.
async fn poll_for(
    client: &tokio_postgres::Client,
    sql: &str,
    want: &str,
    limit: Duration,
) -> Result<bool> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if one_value(client, sql).await? == want {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn write(c: &TestCluster, i: usize, sql: &str) -> Result<W> {
    let client = c.pg[i].connect().await?;
    let lo = parse_lsn(&one_value(&client, "SELECT pg_current_wal_insert_lsn()::text").await?)?;
    let xid = one_value(
        &client,
        &format!("BEGIN; {sql}; SELECT pg_current_xact_id()::text; COMMIT"),
    )
    .await
    .with_context(|| format!("on {}: {sql}", c.pg[i].name()))?;
    let hi = parse_lsn(&one_value(&client, "SELECT pg_current_wal_insert_lsn()::text").await?)?;
    let ts = one_value(
        &client,
        &format!(
            "SELECT {}",
            ts_sql(&format!("pg_xact_commit_timestamp('{xid}'::xid)"))
        ),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(W {
        node: c.pg[i].name().to_owned(),
        ts,
        lsn_lo: lo,
        lsn_hi: hi,
    })
}

/// Runs `sql` on node `i` under a replication origin that is no node's, so
/// no agent sends it anywhere (streams use `origin 'none'`): a way to make a
/// row exist on one node only, without a tombstone anywhere.
async fn write_unreplicated(c: &TestCluster, i: usize, sql: &str) -> Result<()> {
    let client = c.pg[i].connect().await?;
    client
        .batch_execute(
            "SELECT pg_replication_origin_create('test_unreplicated')
               WHERE NOT EXISTS (SELECT 1 FROM pg_replication_origin WHERE roname = 'test_unreplicated');
             SELECT pg_replication_origin_session_setup('test_unreplicated');",
        )
        .await?;
    client.batch_execute(sql).await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// mm.conflict_log.

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Logged {
    ty: String,
    relation: String,
    key: Option<String>,
    local_origin: Option<String>,
    local_ts: Option<String>,
    remote_origin: Option<String>,
    remote_ts: Option<String>,
    resolution: String,
}

#[derive(Debug, Clone)]
struct Expected {
    row: Logged,
    /// The remote transaction's WAL range: remote_lsn must lie in (lo, hi].
    lsn: (u64, u64),
}

/// The conflict_log row a conflict must leave. `key` is the jsonb text as
/// PostgreSQL prints it (`{"id": 1}`); `local` is the write that made the
/// local version (a row or a delete), `None` when there was none.
fn logged(
    ty: &str,
    relation: &str,
    key: &str,
    local: Option<&W>,
    remote: &W,
    resolution: &str,
) -> Expected {
    Expected {
        row: Logged {
            ty: ty.to_owned(),
            relation: relation.to_owned(),
            key: Some(key.to_owned()),
            local_origin: local.map(|w| w.node.clone()),
            local_ts: local.map(|w| w.ts.clone()),
            remote_origin: Some(remote.node.clone()),
            remote_ts: Some(remote.ts.clone()),
            resolution: resolution.to_owned(),
        },
        lsn: (remote.lsn_lo, remote.lsn_hi),
    }
}

async fn conflict_log(c: &TestCluster, i: usize) -> Result<Vec<(Logged, Option<String>)>> {
    let rows = c
        .rows(
            i,
            &format!(
                "SELECT conflict_type, relation, key::text, local_origin, {}, remote_origin, {}, \
                 resolution, remote_lsn::text FROM mm.conflict_log ORDER BY id",
                ts_sql("local_commit_ts"),
                ts_sql("remote_commit_ts")
            ),
        )
        .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let s = |k: usize| r[k].clone().unwrap_or_default();
            (
                Logged {
                    ty: s(0),
                    relation: s(1),
                    key: r[2].clone(),
                    local_origin: r[3].clone(),
                    local_ts: r[4].clone(),
                    remote_origin: r[5].clone(),
                    remote_ts: r[6].clone(),
                    resolution: s(7),
                },
                r[8].clone(),
            )
        })
        .collect())
}

/// Node `i`'s conflict log holds exactly `want` (in any order).
async fn assert_log(c: &TestCluster, i: usize, mut want: Vec<Expected>) -> Result<()> {
    let mut got = conflict_log(c, i).await?;
    got.sort();
    want.sort_by(|a, b| a.row.cmp(&b.row));
    let got_rows: Vec<&Logged> = got.iter().map(|(l, _)| l).collect();
    let want_rows: Vec<&Logged> = want.iter().map(|e| &e.row).collect();
    if got_rows != want_rows {
        bail!(
            "mm.conflict_log on {} differs\n got ({}):\n{}\nwant ({}):\n{}",
            c.pg[i].name(),
            got_rows.len(),
            got_rows
                .iter()
                .map(|r| format!("  {r:?}"))
                .collect::<Vec<_>>()
                .join("\n"),
            want_rows.len(),
            want_rows
                .iter()
                .map(|r| format!("  {r:?}"))
                .collect::<Vec<_>>()
                .join("\n"),
        );
    }
    for ((row, lsn), e) in got.iter().zip(&want) {
        let lsn = lsn
            .as_deref()
            .with_context(|| format!("on {}: remote_lsn is NULL in {row:?}", c.pg[i].name()))?;
        let l = parse_lsn(lsn)?;
        ensure!(
            e.lsn.0 < l && l <= e.lsn.1,
            "on {}: remote_lsn {lsn} of {row:?} is not the remote transaction's commit (it lies in {}..{})",
            c.pg[i].name(),
            fmt_lsn(e.lsn.0),
            fmt_lsn(e.lsn.1)
        );
    }
    Ok(())
}

/// `(local_tuple->>'v', remote_tuple->>'v')` of node `i`'s only conflict of `ty`.
async fn tuple_vs(c: &TestCluster, i: usize, ty: &str) -> Result<(Option<String>, Option<String>)> {
    let rows = c
        .rows(
            i,
            &format!(
                "SELECT local_tuple->>'v', remote_tuple->>'v' FROM mm.conflict_log WHERE conflict_type = '{ty}'"
            ),
        )
        .await?;
    ensure!(
        rows.len() == 1,
        "{} has {} {ty} rows",
        c.pg[i].name(),
        rows.len()
    );
    Ok((rows[0][0].clone(), rows[0][1].clone()))
}

// ---------------------------------------------------------------------------
// Rows.

fn row(cells: &[&str]) -> Vec<Option<String>> {
    cells
        .iter()
        .map(|c| (*c != "NULL").then(|| (*c).to_owned()))
        .collect()
}

async fn assert_rows(c: &TestCluster, i: usize, sql: &str, want: &[&[&str]]) -> Result<()> {
    let got = c.rows(i, sql).await?;
    let want: Vec<Vec<Option<String>>> = want.iter().map(|r| row(r)).collect();
    ensure!(
        got == want,
        "{sql} on {}:\n got {got:?}\nwant {want:?}",
        c.pg[i].name()
    );
    Ok(())
}

/// The commit timestamp of the surviving row `id` of `t` on node `i`.
async fn row_ts(c: &TestCluster, i: usize, table: &str, id: i32) -> Result<Option<String>> {
    c.pg[i]
        .query_one_string(&format!(
            "SELECT {} FROM {table} WHERE id = {id}",
            ts_sql("pg_xact_commit_timestamp(xmin)")
        ))
        .await
}

/// Waits until status shows at least `min` routine changes on the stream
/// `from` -> `to` (the counter is refreshed on the stream's feedback tick, a
/// moment after the changes are applied); returns the last value seen.
async fn wait_routine(c: &TestCluster, from: &str, to: &str, min: u64) -> Result<Option<u64>> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let n = c.stream_status(from, to).await?["routine"].as_u64();
        if n >= Some(min) || std::time::Instant::now() > deadline {
            return Ok(n);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---------------------------------------------------------------------------
// Clusters.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Res {
    Lww,
    Fww,
    ApplyRemote,
    KeepLocal,
}

impl Res {
    fn name(self) -> &'static str {
        match self {
            Res::Lww => "last_writer_wins",
            Res::Fww => "first_writer_wins",
            Res::ApplyRemote => "apply_remote",
            Res::KeepLocal => "keep_local",
        }
    }

    /// Does the incoming change win, when it is (not) the later one? (Every
    /// scenario here has a local version: a row or a tombstone.)
    fn remote_wins(self, remote_is_later: bool) -> bool {
        match self {
            Res::Lww => remote_is_later,
            Res::Fww => !remote_is_later,
            Res::ApplyRemote => true,
            Res::KeepLocal => false,
        }
    }

    fn label(self, remote_is_later: bool) -> &'static str {
        if self.remote_wins(remote_is_later) {
            "apply_remote"
        } else {
            "keep_local"
        }
    }
}

async fn cluster_with(names: &[&str], schema: &str, agent_toml: &str) -> Result<TestCluster> {
    TestCluster::start_opts(
        names,
        schema,
        ClusterOptions {
            agent_toml: agent_toml.to_owned(),
            ..ClusterOptions::default()
        },
    )
    .await
}

async fn cluster(names: &[&str], schema: &str, res: Res) -> Result<TestCluster> {
    cluster_with(
        names,
        schema,
        &format!("[conflicts]\nresolver = \"{}\"\n", res.name()),
    )
    .await
}

fn pair(prefix: &str) -> [String; 2] {
    [format!("{prefix}1"), format!("{prefix}2")]
}

/// Pauses both streams between nodes 0 and 1.
async fn pause_both(c: &TestCluster) -> Result<()> {
    let (a, b) = (c.agents[0].name.clone(), c.agents[1].name.clone());
    c.pause(&a, &b).await?;
    c.pause(&b, &a).await
}

async fn resume_both_and_sync(c: &TestCluster) -> Result<()> {
    let (a, b) = (c.agents[0].name.clone(), c.agents[1].name.clone());
    c.resume(&a, &b).await?;
    c.resume(&b, &a).await?;
    c.wait_sync(90).await
}

/// Inserts the rows of `sql` on node 0 and waits until every node has them.
/// Two nodes `{prefix}1`, `{prefix}2` with table t holding key 1 ('init'),
/// replicated to both, and both streams paused: the start of every
/// two-writer scenario on one key.
async fn paused_pair(prefix: &str, res: Res) -> Result<([String; 2], TestCluster)> {
    let names = pair(prefix);
    let c = cluster(&[&names[0], &names[1]], T_SCHEMA, res).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'init')").await?;
    pause_both(&c).await?;
    Ok((names, c))
}

async fn seed(c: &TestCluster, sql: &str) -> Result<()> {
    c.pg[0].execute(sql).await?;
    c.wait_sync(60).await?;
    tokio::time::sleep(WATERMARK_SETTLE).await;
    Ok(())
}

// ---------------------------------------------------------------------------
// Two-node scenarios, parameterized by resolver. A writes first, B second.

/// Both insert key 1: insert_exists on both sides.
async fn insert_exists(prefix: &str, res: Res) -> Result<()> {
    let names = pair(prefix);
    let c = cluster(&[&names[0], &names[1]], T_SCHEMA, res).await?;
    pause_both(&c).await?;
    let wa = write(&c, 0, "INSERT INTO t VALUES (1, 'a')").await?;
    let wb = write(&c, 1, "INSERT INTO t VALUES (1, 'b')").await?;
    resume_both_and_sync(&c).await?;

    let key = r#"{"id": 1}"#;
    // On A the incoming insert (B's) is the later one; on B it is the earlier.
    let (on_a, on_b) = (res.remote_wins(true), res.remote_wins(false));
    assert_rows(&c, 0, DUMP_T, &[&["1", if on_a { "b" } else { "a" }]]).await?;
    assert_rows(&c, 1, DUMP_T, &[&["1", if on_b { "a" } else { "b" }]]).await?;
    assert_log(
        &c,
        0,
        vec![logged(
            "insert_exists",
            "public.t",
            key,
            Some(&wa),
            &wb,
            res.label(true),
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "insert_exists",
            "public.t",
            key,
            Some(&wb),
            &wa,
            res.label(false),
        )],
    )
    .await?;
    // The log keeps both versions of the row.
    assert_eq!(
        tuple_vs(&c, 0, "insert_exists").await?,
        (Some("a".into()), Some("b".into()))
    );
    assert_eq!(
        tuple_vs(&c, 1, "insert_exists").await?,
        (Some("b".into()), Some("a".into()))
    );
    // A row taken from the peer keeps the peer's commit timestamp.
    if on_a {
        assert_eq!(row_ts(&c, 0, "t", 1).await?, Some(wb.ts.clone()));
    }
    if on_b {
        assert_eq!(row_ts(&c, 1, "t", 1).await?, Some(wa.ts.clone()));
    }
    Ok(())
}

/// Both update key 1 (inserted on A and replicated first): update_origin_differs.
async fn update_origin_differs(prefix: &str, res: Res) -> Result<()> {
    let (_, c) = paused_pair(prefix, res).await?;
    let wa = write(&c, 0, "UPDATE t SET v = 'a' WHERE id = 1").await?;
    let wb = write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;

    let key = r#"{"id": 1}"#;
    let (on_a, on_b) = (res.remote_wins(true), res.remote_wins(false));
    assert_rows(&c, 0, DUMP_T, &[&["1", if on_a { "b" } else { "a" }]]).await?;
    assert_rows(&c, 1, DUMP_T, &[&["1", if on_b { "a" } else { "b" }]]).await?;
    assert_log(
        &c,
        0,
        vec![logged(
            "update_origin_differs",
            "public.t",
            key,
            Some(&wa),
            &wb,
            res.label(true),
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "update_origin_differs",
            "public.t",
            key,
            Some(&wb),
            &wa,
            res.label(false),
        )],
    )
    .await?;
    assert_eq!(
        tuple_vs(&c, 0, "update_origin_differs").await?,
        (Some("a".into()), Some("b".into()))
    );
    Ok(())
}

/// A updates key 1 while B deletes it; `delete_first`: B's delete commits
/// before A's update, else after. A sees delete_origin_differs (its row vs
/// B's delete), B sees update_deleted (its tombstone vs A's update).
async fn update_vs_delete(prefix: &str, res: Res, delete_first: bool) -> Result<()> {
    let (_, c) = paused_pair(prefix, res).await?;
    let (wa, wb) = if delete_first {
        let wb = write(&c, 1, "DELETE FROM t WHERE id = 1").await?;
        let wa = write(&c, 0, "UPDATE t SET v = 'a' WHERE id = 1").await?;
        (wa, wb)
    } else {
        let wa = write(&c, 0, "UPDATE t SET v = 'a' WHERE id = 1").await?;
        let wb = write(&c, 1, "DELETE FROM t WHERE id = 1").await?;
        (wa, wb)
    };
    resume_both_and_sync(&c).await?;

    let key = r#"{"id": 1}"#;
    // On A the incoming change is B's delete; on B, A's update.
    let delete_is_later = !delete_first;
    let on_a = res.remote_wins(delete_is_later);
    let on_b = res.remote_wins(!delete_is_later);
    // A: the delete wins -> no row; else A's updated row stays.
    let a_rows: &[&[&str]] = if on_a { &[] } else { &[&["1", "a"]] };
    // B: the update wins -> it becomes an insert of A's full row; else deleted.
    let b_rows: &[&[&str]] = if on_b { &[&["1", "a"]] } else { &[] };
    assert_rows(&c, 0, DUMP_T, a_rows).await?;
    assert_rows(&c, 1, DUMP_T, b_rows).await?;
    assert_log(
        &c,
        0,
        vec![logged(
            "delete_origin_differs",
            "public.t",
            key,
            Some(&wa),
            &wb,
            res.label(delete_is_later),
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "update_deleted",
            "public.t",
            key,
            Some(&wb),
            &wa,
            res.label(!delete_is_later),
        )],
    )
    .await?;
    if on_b {
        // The row B re-created carries A's update's commit timestamp.
        assert_eq!(row_ts(&c, 1, "t", 1).await?, Some(wa.ts.clone()));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// last_writer_wins (the default): every conflict type.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_insert_exists() -> Result<()> {
    mm_tests::init_tracing();
    insert_exists("lie", Res::Lww).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_update_origin_differs() -> Result<()> {
    mm_tests::init_tracing();
    update_origin_differs("luo", Res::Lww).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_update_then_later_delete() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("lud", Res::Lww, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_delete_then_later_update() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("ldu", Res::Lww, true).await
}

/// Five updates of one key from A meet B's newer update on B, one after
/// another: five conflicts, each judged against B's row. Only the first
/// is found by a fast-path attempt that is rolled back; the rest, their
/// key having just conflicted (`hot.rs`), settle it inside their own
/// fast-path statement (`sql::fast_update_in_place`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_repeated_conflicts_on_one_key_roll_back_the_fast_path_once() -> Result<()> {
    mm_tests::init_tracing();
    let (names, c) = paused_pair("lhk", Res::Lww).await?;
    let mut wa = Vec::new();
    for i in 0..5 {
        wa.push(write(&c, 0, &format!("UPDATE t SET v = 'a{i}' WHERE id = 1")).await?);
    }
    let wb = write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;

    let key = r#"{"id": 1}"#;
    assert_rows(&c, 0, DUMP_T, &[&["1", "b"]]).await?;
    assert_rows(&c, 1, DUMP_T, &[&["1", "b"]]).await?;
    assert_log(
        &c,
        1,
        wa.iter()
            .map(|w| {
                logged(
                    "update_origin_differs",
                    "public.t",
                    key,
                    Some(&wb),
                    w,
                    "keep_local",
                )
            })
            .collect(),
    )
    .await?;
    assert_log(
        &c,
        0,
        vec![logged(
            "update_origin_differs",
            "public.t",
            key,
            wa.last(),
            &wb,
            "apply_remote",
        )],
    )
    .await?;
    let s = c.stream_status(&names[0], &names[1]).await?;
    assert_eq!(s["conflicts"]["update_origin_differs"], 5, "{s}");
    assert_eq!(s["conflict_rollbacks"], 1, "{s}");
    assert_eq!(s["conflicts_in_place"], 4, "{s}");
    Ok(())
}

/// Updates of one key alternate between A and B while both streams are
/// paused. After the first conflict in each direction the key is hot and
/// every later conflict on it is settled in place, keeping the local row
/// or taking the incoming one exactly as the careful path would: the same
/// winners, the same conflict log (each judged against the receiver's
/// newest version), identical nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_conflicts_on_a_hot_key_are_settled_in_place_both_ways() -> Result<()> {
    mm_tests::init_tracing();
    let (names, c) = paused_pair("lip", Res::Lww).await?;
    let a0 = write(&c, 0, "UPDATE t SET v = 'a0' WHERE id = 1").await?;
    let b1 = write(&c, 1, "UPDATE t SET v = 'b1' WHERE id = 1").await?;
    let a2 = write(&c, 0, "UPDATE t SET v = 'a2' WHERE id = 1").await?;
    let b3 = write(&c, 1, "UPDATE t SET v = 'b3' WHERE id = 1").await?;
    let a4 = write(&c, 0, "UPDATE t SET v = 'a4' WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;

    let key = r#"{"id": 1}"#;
    let odd = "update_origin_differs";
    assert_rows(&c, 0, DUMP_T, &[&["1", "a4"]]).await?;
    assert_rows(&c, 1, DUMP_T, &[&["1", "a4"]]).await?;
    // On B, A's changes meet b3: older ones lose, a4 wins.
    assert_log(
        &c,
        1,
        vec![
            logged(odd, "public.t", key, Some(&b3), &a0, "keep_local"),
            logged(odd, "public.t", key, Some(&b3), &a2, "keep_local"),
            logged(odd, "public.t", key, Some(&b3), &a4, "apply_remote"),
        ],
    )
    .await?;
    // On A, B's changes meet a4 and lose.
    assert_log(
        &c,
        0,
        vec![
            logged(odd, "public.t", key, Some(&a4), &b1, "keep_local"),
            logged(odd, "public.t", key, Some(&a4), &b3, "keep_local"),
        ],
    )
    .await?;
    let into_b = c.stream_status(&names[0], &names[1]).await?;
    assert_eq!(into_b["conflicts"][odd], 3, "{into_b}");
    assert_eq!(into_b["conflict_rollbacks"], 1, "{into_b}");
    assert_eq!(into_b["conflicts_in_place"], 2, "{into_b}");
    let into_a = c.stream_status(&names[1], &names[0]).await?;
    assert_eq!(into_a["conflicts"][odd], 2, "{into_a}");
    assert_eq!(into_a["conflict_rollbacks"], 1, "{into_a}");
    assert_eq!(into_a["conflicts_in_place"], 1, "{into_a}");
    c.assert_same(DUMP_T).await?;
    Ok(())
}

/// On a hot key, a remote update settled in place must be judged against
/// the version it locks. Here it waits for the lock of a local transaction
/// that updates the key and commits after the remote change did, i.e. is
/// newer and wins everywhere. The statement's snapshot predates that
/// commit, so the version it first reads is the one before; the commit
/// timestamp and origin it judges by must come from the version it locked
/// (read with the row, not from a join PostgreSQL does not re-run when it
/// rechecks a row updated meanwhile). Judged against the stale version,
/// B took A's older change over its own newer one and kept it, while A
/// took B's: the nodes diverged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_update_waiting_for_a_newer_local_update_loses_to_it() -> Result<()> {
    hot_key_change_waits_for_a_newer_local_update("liw", "UPDATE t SET v = 'a2' WHERE id = 1").await
}

/// The same for the careful path (`sql::fetch_rows`), where a change to a
/// hot key that cannot be settled in place goes: A's delete waits for the
/// lock of B's newer update, and loses to it on B as it does on A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_delete_waiting_for_a_newer_local_update_loses_to_it() -> Result<()> {
    hot_key_change_waits_for_a_newer_local_update("ldw", "DELETE FROM t WHERE id = 1").await
}

async fn hot_key_change_waits_for_a_newer_local_update(prefix: &str, remote: &str) -> Result<()> {
    mm_tests::init_tracing();
    let in_place = remote.starts_with("UPDATE");
    let (names, c) = paused_pair(prefix, Res::Lww).await?;
    write(&c, 0, "UPDATE t SET v = 'a0' WHERE id = 1").await?;
    write(&c, 1, "UPDATE t SET v = 'b1' WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;
    // The key is hot on B now (A's a0 met b1 there).
    let local = c.pg[1].connect().await?;
    local
        .batch_execute("BEGIN; UPDATE t SET v = 'b local' WHERE id = 1")
        .await?;
    let wa = write(&c, 0, remote).await?;
    c.pg[1]
        .wait_for_agent_lock_wait(Duration::from_secs(30), "A's change")
        .await?;
    local.batch_execute("COMMIT").await?;
    c.wait_sync(60).await?;
    // The local update committed last: it wins on both nodes.
    assert_rows(&c, 1, DUMP_T, &[&["1", "b local"]]).await?;
    assert_rows(&c, 0, DUMP_T, &[&["1", "b local"]]).await?;
    let on_b = c
        .rows(
            1,
            &format!(
                "SELECT resolution, local_origin FROM mm.conflict_log \
                 WHERE remote_commit_ts = '{}'::timestamptz",
                wa.ts
            ),
        )
        .await?;
    assert_eq!(
        on_b,
        vec![vec![Some("keep_local".to_owned()), Some(names[1].clone())]],
        "A's change on B: judged against the local version it waited for"
    );
    let into_b = c.stream_status(&names[0], &names[1]).await?;
    anyhow::ensure!(
        !in_place || into_b["conflicts_in_place"].as_u64() >= Some(1),
        "the update was not settled in place, the case under test: {into_b}"
    );
    Ok(())
}

/// On a hot key the in-place statement also tells a routine change from a
/// conflict (`mm.routine_full`'s rule, written out in
/// `sql::fast_update_in_place`): after the key conflicted, B updates it, A
/// receives that and, once B's watermark says so, updates it again. On B
/// that update meets B's own row version, which A had seen: applied,
/// counted as routine, not logged, no rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routine_update_of_a_hot_key_is_applied_in_place_without_a_conflict() -> Result<()> {
    mm_tests::init_tracing();
    let (names, c) = paused_pair("lir", Res::Lww).await?;
    let wa = write(&c, 0, "UPDATE t SET v = 'a' WHERE id = 1").await?;
    let wb = write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;
    let key = r#"{"id": 1}"#;
    let odd = "update_origin_differs";
    let first = vec![logged(odd, "public.t", key, Some(&wb), &wa, "keep_local")];
    assert_log(&c, 1, first.clone()).await?;
    let before = c.stream_status(&names[0], &names[1]).await?;
    assert_eq!(before["conflict_rollbacks"], 1, "{before}");
    let routine_before = before["routine"].as_u64().unwrap_or(0);

    write(&c, 1, "UPDATE t SET v = 'b again' WHERE id = 1").await?;
    c.wait_sync(60).await?;
    tokio::time::sleep(WATERMARK_SETTLE).await;
    write(&c, 0, "UPDATE t SET v = 'a after b' WHERE id = 1").await?;
    c.wait_sync(60).await?;

    assert_rows(&c, 0, DUMP_T, &[&["1", "a after b"]]).await?;
    assert_rows(&c, 1, DUMP_T, &[&["1", "a after b"]]).await?;
    assert_log(&c, 1, first).await?;
    let routine = wait_routine(&c, &names[0], &names[1], routine_before + 1).await?;
    assert!(
        routine >= Some(routine_before + 1),
        "A's update of B's row, after A saw it, is routine on B: {routine:?} (was {routine_before})"
    );
    let after = c.stream_status(&names[0], &names[1]).await?;
    assert_eq!(after["conflicts"][odd], 1, "{after}");
    assert_eq!(after["conflict_rollbacks"], 1, "{after}");
    c.assert_same(DUMP_T).await?;
    Ok(())
}

/// A careful-path write is sent without waiting for its reply
/// (`deferred.rs`). When it fails, the error reported is its own, not the
/// "transaction is aborted" of the statements sent behind it, and nothing
/// of the transaction commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_careful_write_reports_its_own_error_and_commits_nothing() -> Result<()> {
    mm_tests::init_tracing();
    let names = pair("lcw");
    let c = cluster(&[&names[0], &names[1]], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'init')").await?;
    // Only on B: the winning update below breaks it there.
    c.pg[1]
        .execute("ALTER TABLE t ADD CONSTRAINT short_v CHECK (length(v) < 8)")
        .await?;
    pause_both(&c).await?;
    write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 1").await?;
    // Later than B's: it wins on B, in the careful path, and fails there.
    write(&c, 0, "UPDATE t SET v = 'far too long' WHERE id = 1").await?;
    c.resume(&names[0], &names[1]).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let err = loop {
        let s = c.stream_status(&names[0], &names[1]).await?;
        if let Some(e) = s["last_error"].as_str() {
            break e.to_owned();
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the stream never stopped: {s}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(
        err.contains("short_v") && err.contains("23514") && !err.contains("25P02"),
        "not the failed write's own error: {err}"
    );
    assert_rows(&c, 1, DUMP_T, &[&["1", "b"]]).await?;
    assert_log(&c, 1, vec![]).await?;
    // Fixed by the operator, the same transaction applies (at the
    // stream's next retry).
    c.pg[1]
        .execute("ALTER TABLE t DROP CONSTRAINT short_v")
        .await?;
    c.wait_for(
        1,
        "SELECT v FROM t WHERE id = 1",
        "far too long",
        Duration::from_secs(60),
    )
    .await?;
    c.resume(&names[1], &names[0]).await?;
    c.wait_sync(90).await?;
    c.assert_same(DUMP_T).await?;
    assert_rows(&c, 1, DUMP_T, &[&["1", "far too long"]]).await
}

/// An update of a row the receiving node never had (and never deleted)
/// becomes an insert of the full new row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_update_missing() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["lum1", "lum2"], T_SCHEMA, Res::Lww).await?;
    write_unreplicated(&c, 0, "INSERT INTO t VALUES (1, 'only on A')").await?;
    let wa = write(&c, 0, "UPDATE t SET v = 'a' WHERE id = 1").await?;
    c.wait_sync(60).await?;
    let want: &[&[&str]] = &[&["1", "a"]];
    assert_rows(&c, 0, DUMP_T, want).await?;
    assert_rows(&c, 1, DUMP_T, want).await?;
    assert_eq!(row_ts(&c, 1, "t", 1).await?, Some(wa.ts.clone()));
    assert_log(&c, 0, vec![]).await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "update_missing",
            "public.t",
            r#"{"id": 1}"#,
            None,
            &wa,
            "apply_remote",
        )],
    )
    .await
}

/// A delete of a row the receiving node never had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_delete_missing() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["ldm1", "ldm2"], T_SCHEMA, Res::Lww).await?;
    write_unreplicated(&c, 0, "INSERT INTO t VALUES (1, 'only on A')").await?;
    let wa = write(&c, 0, "DELETE FROM t WHERE id = 1").await?;
    c.wait_sync(60).await?;
    assert_rows(&c, 0, DUMP_T, &[]).await?;
    assert_rows(&c, 1, DUMP_T, &[]).await?;
    assert_log(&c, 0, vec![]).await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "delete_missing",
            "public.t",
            r#"{"id": 1}"#,
            None,
            &wa,
            "apply_remote",
        )],
    )
    .await
}

/// Both delete the same row: each side's local version is its own
/// tombstone; the later delete is the one both keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_delete_missing_both_deleted() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["ldd1", "ldd2"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'init')").await?;
    pause_both(&c).await?;
    let wa = write(&c, 0, "DELETE FROM t WHERE id = 1").await?;
    let wb = write(&c, 1, "DELETE FROM t WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;
    assert_rows(&c, 0, DUMP_T, &[]).await?;
    assert_rows(&c, 1, DUMP_T, &[]).await?;
    let key = r#"{"id": 1}"#;
    assert_log(
        &c,
        0,
        vec![logged(
            "delete_missing",
            "public.t",
            key,
            Some(&wa),
            &wb,
            "apply_remote",
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "delete_missing",
            "public.t",
            key,
            Some(&wb),
            &wa,
            "keep_local",
        )],
    )
    .await
}

const U_SCHEMA: &str = "CREATE TABLE u (id int PRIMARY KEY, email text NOT NULL UNIQUE, v text);";
const DUMP_U: &str = "SELECT id, email, v FROM u ORDER BY id";

/// B changes row 2's unique column to a value A's new row 3 holds.
/// A: update_exists (B's later update wins, A's row 3 goes);
/// B: the insert of row 3 collides on the unique column (insert_exists, B's
/// later row wins). Both end with rows 1 and 2 only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_update_exists() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["lux1", "lux2"], U_SCHEMA, Res::Lww).await?;
    seed(
        &c,
        "INSERT INTO u VALUES (1, 'x1', 'init'), (2, 'x2', 'init')",
    )
    .await?;
    pause_both(&c).await?;
    let wa = write(&c, 0, "INSERT INTO u VALUES (3, 'y', 'a')").await?;
    let wb = write(&c, 1, "UPDATE u SET email = 'y', v = 'b' WHERE id = 2").await?;
    resume_both_and_sync(&c).await?;
    let want: &[&[&str]] = &[&["1", "x1", "init"], &["2", "y", "b"]];
    assert_rows(&c, 0, DUMP_U, want).await?;
    assert_rows(&c, 1, DUMP_U, want).await?;
    assert_log(
        &c,
        0,
        vec![logged(
            "update_exists",
            "public.u",
            r#"{"id": 2}"#,
            Some(&wa),
            &wb,
            "apply_remote",
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "insert_exists",
            "public.u",
            r#"{"id": 3}"#,
            Some(&wb),
            &wa,
            "keep_local",
        )],
    )
    .await
}

/// Two rows moved onto one unique value at once: A sets row 21's email to
/// 'K', slightly later B sets row 23's. Where B's (later) change arrives the
/// colliding row 21 gives way; where A's (older) one arrives it loses, and
/// the row it moved (21) is deleted too, so every node keeps only row 23.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_two_rows_moved_onto_one_unique_value() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["lmv1", "lmv2"], U_SCHEMA, Res::Lww).await?;
    seed(
        &c,
        "INSERT INTO u VALUES (21, 'e21', 'init'), (22, 'e22', 'init'), (23, 'e23', 'init')",
    )
    .await?;
    pause_both(&c).await?;
    let wa = write(&c, 0, "UPDATE u SET email = 'K', v = 'a' WHERE id = 21").await?;
    let wb = write(&c, 1, "UPDATE u SET email = 'K', v = 'b' WHERE id = 23").await?;
    resume_both_and_sync(&c).await?;
    let want: &[&[&str]] = &[&["22", "e22", "init"], &["23", "K", "b"]];
    assert_rows(&c, 0, DUMP_U, want).await?;
    assert_rows(&c, 1, DUMP_U, want).await?;
    assert_log(
        &c,
        0,
        vec![logged(
            "update_exists",
            "public.u",
            r#"{"id": 23}"#,
            Some(&wa),
            &wb,
            "apply_remote",
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "update_exists",
            "public.u",
            r#"{"id": 21}"#,
            Some(&wb),
            &wa,
            "deleted",
        )],
    )
    .await
}

/// The same with primary keys: A changes key 4 to 6, slightly later B
/// changes key 5 to 6. Every node ends with B's row 6 only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_two_keys_moved_onto_one_key() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["lmk1", "lmk2", "lmk3"], T_SCHEMA, Res::Lww).await?;
    seed(
        &c,
        "INSERT INTO t VALUES (4, 'four'), (5, 'five'), (7, 'seven')",
    )
    .await?;
    for (from, to) in [
        ("lmk1", "lmk2"),
        ("lmk2", "lmk1"),
        ("lmk1", "lmk3"),
        ("lmk2", "lmk3"),
    ] {
        c.pause(from, to).await?;
    }
    let wa = write(&c, 0, "UPDATE t SET id = 6, v = 'a' WHERE id = 4").await?;
    let wb = write(&c, 1, "UPDATE t SET id = 6, v = 'b' WHERE id = 5").await?;
    // The third node gets the older change first.
    c.resume("lmk1", "lmk3").await?;
    c.wait_for(
        2,
        "SELECT v FROM t WHERE id = 6",
        "a",
        Duration::from_secs(30),
    )
    .await?;
    for (from, to) in [("lmk1", "lmk2"), ("lmk2", "lmk1"), ("lmk2", "lmk3")] {
        c.resume(from, to).await?;
    }
    c.wait_sync(90).await?;
    let want: &[&[&str]] = &[&["6", "b"], &["7", "seven"]];
    for i in 0..3 {
        assert_rows(&c, i, DUMP_T, want).await?;
    }
    // A key change is a delete of the old key and an insert at the new
    // one: the old keys go without conflict (their rows were the seed's),
    // the two inserts at key 6 meet, and the later one wins on both.
    assert_log(
        &c,
        0,
        vec![logged(
            "update_exists",
            "public.t",
            r#"{"id": 6}"#,
            Some(&wa),
            &wb,
            "apply_remote",
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "update_exists",
            "public.t",
            r#"{"id": 6}"#,
            Some(&wb),
            &wa,
            "keep_local",
        )],
    )
    .await
}

/// A key change races a later update of the row's OLD key on another node:
/// A moves row 1 to key 2; B, not having seen it, updates row 1. A key
/// change is a delete of the old key and an insert at the new one, each
/// judged on its own key: B's update is newer than the delete of key 1, so
/// key 1 keeps B's row, and key 2 gets the moved row, on every node. Before
/// key changes were split so, B kept only row 1 (the move lost to its newer
/// version) and A had both rows (no tombstone for key 1: B's update came
/// back as an insert).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_key_change_vs_later_update_of_the_old_key() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["lkc1", "lkc2", "lkc3"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'one')").await?;
    for (from, to) in [
        ("lkc1", "lkc2"),
        ("lkc2", "lkc1"),
        ("lkc1", "lkc3"),
        ("lkc2", "lkc3"),
    ] {
        c.pause(from, to).await?;
    }
    write(&c, 0, "UPDATE t SET id = 2 WHERE id = 1").await?;
    write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 1").await?;
    // The third node gets B's update first, then the older move.
    c.resume("lkc2", "lkc3").await?;
    c.wait_for(
        2,
        "SELECT v FROM t WHERE id = 1",
        "b",
        Duration::from_secs(30),
    )
    .await?;
    for (from, to) in [("lkc1", "lkc3"), ("lkc1", "lkc2"), ("lkc2", "lkc1")] {
        c.resume(from, to).await?;
    }
    c.wait_sync(90).await?;
    let want: &[&[&str]] = &[&["1", "b"], &["2", "one"]];
    for i in 0..3 {
        assert_rows(&c, i, DUMP_T, want).await?;
    }
    // The originating node recorded the old key's delete (mm_key_changes).
    let tomb = c.pg[0]
        .query_one_string("SELECT count(*) FROM mm.tombstones WHERE key = '{\"id\": 1}'")
        .await?;
    ensure!(
        tomb.as_deref() == Some("1"),
        "no tombstone for the moved-away key on lkc1: {tomb:?}"
    );
    Ok(())
}

/// The chain of the test below, up to the collision: row 1 at 'K' on A
/// (`names[0]`), B's move of row 2 onto 'K' and away to 'M' applied on C
/// only. Every stream but B -> C stays paused, and `also_paused` too.
async fn stage_collision(
    c: &TestCluster,
    names: [&str; 3],
    also_paused: &[(&str, &str)],
) -> Result<()> {
    let [a, b, cc] = names;
    seed(
        c,
        "INSERT INTO u VALUES (1, 'x1', 'init'), (2, 'x2', 'init')",
    )
    .await?;
    for &(from, to) in [(a, b), (b, a), (a, cc), (b, cc)].iter().chain(also_paused) {
        c.pause(from, to).await?;
    }
    write(c, 0, "UPDATE u SET email = 'K', v = 'a' WHERE id = 1").await?;
    write(c, 1, "UPDATE u SET email = 'K', v = 'b' WHERE id = 2").await?;
    write(c, 1, "UPDATE u SET email = 'M' WHERE id = 2").await?;
    // C and B see B's move away before A's change arrives: no collision
    // there. A gets B's changes while holding row 1 at 'K'.
    c.resume(b, cc).await?;
    c.wait_for(
        2,
        "SELECT email FROM u WHERE id = 2",
        "M",
        Duration::from_secs(30),
    )
    .await
}

/// A chain the per-key rules alone cannot settle: A moves row 1 onto email
/// 'K'; later B moves row 2 onto 'K' and then away to 'M'. Where B's first
/// change meets A's (on A), row 1 gives way; a node that gets B's changes
/// before A's never sees the two at once and would keep row 1. A's node
/// sends a compensating delete of row 1 after the collision, newer than
/// both, and every node ends without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_unique_collision_compensates_on_nodes_that_never_saw_it() -> Result<()> {
    mm_tests::init_tracing();
    let names = ["luc1", "luc2", "luc3"];
    let c = cluster(&names, U_SCHEMA, Res::Lww).await?;
    stage_collision(&c, names, &[]).await?;
    c.resume("luc1", "luc3").await?;
    c.resume("luc1", "luc2").await?;
    c.resume("luc2", "luc1").await?;
    c.wait_sync(90).await?;
    let want: &[&[&str]] = &[&["2", "M", "b"]];
    for i in 0..3 {
        assert_rows(&c, i, DUMP_U, want).await?;
    }
    let sent = c.pg[0]
        .query_one_string(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM mm.compensations_id_seq",
        )
        .await?;
    ensure!(
        sent.as_deref() == Some("1"),
        "luc1 recorded {sent:?} compensating deletes, want 1"
    );
    Ok(())
}

/// A compensating delete raises its key's tombstone without deleting a
/// row, so PostgreSQL does not order it against an apply session that
/// reads the same tombstone: once, A's compensating delete of row 1 (at
/// A's time) committed while C's older delete of row 1 was being applied
/// on A; the apply had read the tombstone before and wrote its older
/// version over the compensation's after, and a later insert of row 1
/// from C, older than the compensation, then got in on A only
/// (`e2e_convergence` seed_b, `MM_SEED=13`). The compensating delete now
/// holds the apply gate like a careful transaction, and locks the table
/// against users' writes. Here a trigger holds it open for seconds, after
/// its tombstone and before its commit, while C's delete and insert of
/// row 1 arrive and a user on A inserts row 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensating_delete_is_ordered_against_apply_of_the_same_key() -> Result<()> {
    mm_tests::init_tracing();
    let names = ["lco1", "lco2", "lco3"];
    let c = cluster(&names, U_SCHEMA, Res::Lww).await?;
    // The compensation, as in the test above: lco1 will meet B's move of
    // row 2 onto 'K' while holding row 1 there. lco3's stream to lco1
    // waits too.
    stage_collision(&c, names, &[("lco3", "lco1")]).await?;
    // Hold lco1's compensating delete open after its tombstone is written.
    c.pg[0]
        .execute(
            "CREATE FUNCTION public.hold_compensation() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_sleep(4); RETURN OLD; END $$;
             CREATE TRIGGER hold BEFORE DELETE ON mm.compensations
               FOR EACH ROW EXECUTE FUNCTION public.hold_compensation();",
        )
        .await?;
    c.resume("lco2", "lco1").await?;
    c.wait_for(
        0,
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'",
        "1",
        Duration::from_secs(30),
    )
    .await?;
    // While it is open: lco3 deletes row 1 and inserts it again, both
    // older than the compensation, and lco1 gets them at once. And a user
    // on lco1 inserts row 1: its commit must come after the compensation's
    // (the table is locked against writers), or lco1 alone would keep an
    // insert older than the compensation that deleted it everywhere else.
    write(&c, 2, "DELETE FROM u WHERE id = 1").await?;
    write(&c, 2, "INSERT INTO u VALUES (1, 'z', 'late')").await?;
    c.resume("lco3", "lco1").await?;
    let user = c.pg[0].connect().await?;
    let user = tokio::spawn(async move {
        user.batch_execute("INSERT INTO u VALUES (1, 'u', 'user')")
            .await
    });
    c.resume("lco1", "lco3").await?;
    c.resume("lco1", "lco2").await?;
    user.await?.context("the user's insert of row 1 on lco1")?;
    c.wait_sync(90).await?;
    c.pg[0]
        .execute("DROP TRIGGER hold ON mm.compensations")
        .await?;
    // The user's insert is the newest write of row 1, after the
    // compensation; lco3's are older than both.
    let want: &[&[&str]] = &[&["1", "u", "user"], &["2", "M", "b"]];
    for i in 0..3 {
        assert_rows(&c, i, DUMP_U, want).await?;
    }
    Ok(())
}

/// `wait-sync` until it succeeds or names waiting compensating deletes:
/// it names them only once every stream is seen caught up, which took a
/// few seconds in these tests, cause not found.
async fn wait_sync_until_compensation_shows(
    c: &TestCluster,
) -> Result<mm_tests::agent::MmctlOutput> {
    let mut out = c.mmctl(0, &["wait-sync", "--timeout", "5"]).await?;
    for _ in 0..8 {
        if out.success() || format!("{}{}", out.stdout, out.stderr).contains("not sent yet") {
            break;
        }
        out = c.mmctl(0, &["wait-sync", "--timeout", "5"]).await?;
    }
    Ok(out)
}

/// The other side of that lock: while a user's transaction on A holds
/// the table with a write, A's compensating delete waits for it, and so
/// does `wait-sync`, saying why; the streams into A keep applying (the
/// compensation lets go of the gate between its short tries). Then the
/// table is free but a stream's transaction into A waits for a user's row
/// lock, holding the apply gate: the compensation gives up its turn after
/// a second instead of waiting with every stream queued behind it (and
/// `wait-sync` with it). Once both users are done, the compensation goes
/// out and every node ends alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensating_delete_waits_for_a_users_transaction_and_says_so() -> Result<()> {
    mm_tests::init_tracing();
    let names = ["lcw1", "lcw2", "lcw3"];
    let schema = format!("{U_SCHEMA} CREATE TABLE w (id int PRIMARY KEY, v text);");
    let c = cluster(&names, &schema, Res::Lww).await?;
    // Replicated by the seed's wait-sync: lcw3's stream is idle when the
    // first wait-sync below runs.
    write(&c, 2, "INSERT INTO w VALUES (1, 'a')").await?;
    stage_collision(&c, names, &[]).await?;
    let table_user = c.pg[0].connect().await?;
    table_user
        .batch_execute("BEGIN; INSERT INTO u VALUES (9, 'held', 'user')")
        .await?;
    c.resume("lcw2", "lcw1").await?;
    c.resume("lcw1", "lcw3").await?;
    c.resume("lcw1", "lcw2").await?;
    // lcw1 applied lcw2's changes (row 2 at 'M') though its compensation
    // cannot go yet.
    c.wait_for(
        0,
        "SELECT email FROM u WHERE id = 2",
        "M",
        Duration::from_secs(30),
    )
    .await?;
    let not_sent = |why: &str, out: &mm_tests::agent::MmctlOutput| -> Result<()> {
        ensure!(
            !out.success()
                && format!("{}{}", out.stdout, out.stderr)
                    .contains("compensating delete(s) not sent yet"),
            "wait-sync with a compensation held up by {why}:\n{}{}",
            out.stdout,
            out.stderr
        );
        Ok(())
    };
    let out = wait_sync_until_compensation_shows(&c).await?;
    not_sent("a user's write on its table", &out)?;
    let waiting = c.pg[0]
        .query_one_string("SELECT count(*) FROM mm.compensations")
        .await?;
    ensure!(
        waiting.as_deref() == Some("1"),
        "waiting compensations: {waiting:?}"
    );
    // A user's row lock on w holds lcw3's update of it (and the gate).
    let row_user = c.pg[0].connect().await?;
    row_user
        .batch_execute("BEGIN; SELECT * FROM w WHERE id = 1 FOR UPDATE")
        .await?;
    write(&c, 2, "UPDATE w SET v = 'b' WHERE id = 1").await?;
    c.wait_for(
        0,
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'",
        "1",
        Duration::from_secs(30),
    )
    .await?;
    table_user.batch_execute("COMMIT").await?;
    // More due ones (keys no row holds): each waiting a second for the
    // gate in turn would also keep `/v1/wal-lsn` past its timeout.
    c.pg[0]
        .execute(
            "INSERT INTO mm.compensations (relid, key, not_before) \
             SELECT 'u'::regclass, jsonb_build_object('id', k), now() FROM generate_series(100, 111) k",
        )
        .await?;
    // wait-sync sends due compensations first (`/v1/wal-lsn`): one that
    // waited for the gate without end held it up past its HTTP timeout.
    let out = c.mmctl(0, &["wait-sync", "--timeout", "3"]).await?;
    let text = format!("{}{}", out.stdout, out.stderr);
    ensure!(
        !out.success() && text.contains("lcw3 → lcw1 ("),
        "wait-sync while lcw3's update waits for a user's row lock on lcw1 \
         and lcw1's compensation waits for the gate:\n{text}"
    );
    row_user.batch_execute("COMMIT").await?;
    c.wait_sync(90).await?;
    let want: &[&[&str]] = &[&["2", "M", "b"], &["9", "held", "user"]];
    for i in 0..3 {
        assert_rows(&c, i, DUMP_U, want).await?;
        assert_rows(&c, i, "SELECT id, v FROM w", &[&["1", "b"]]).await?;
    }
    Ok(())
}

/// A compensating delete whose row is back and locked by a user's
/// transaction (`SELECT .. FOR UPDATE`) waits for it like one held up by a
/// writer: `wait-sync` says so (the function used to fail on its lock
/// timeout, and wait-sync with it), and once the user commits, the row is
/// deleted on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensating_delete_of_a_row_a_user_has_locked_waits_for_it() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["lcr1", "lcr2"], U_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO u VALUES (1, 'x1', 'init')").await?;
    let user = c.pg[0].connect().await?;
    user.batch_execute("BEGIN; SELECT * FROM u WHERE id = 1 FOR UPDATE")
        .await?;
    // As the apply path records one (its key's row gave way on a unique
    // value elsewhere), due at once.
    c.pg[0]
        .execute(
            "INSERT INTO mm.compensations (relid, key, not_before) \
             VALUES ('u'::regclass, '{\"id\": 1}', now() - interval '1 s')",
        )
        .await?;
    let out = wait_sync_until_compensation_shows(&c).await?;
    ensure!(
        !out.success()
            && format!("{}{}", out.stdout, out.stderr)
                .contains("compensating delete(s) not sent yet"),
        "wait-sync with a compensation held up by a user's row lock:\n{}{}",
        out.stdout,
        out.stderr
    );
    user.batch_execute("COMMIT").await?;
    c.wait_sync(60).await?;
    for i in 0..2 {
        assert_rows(&c, i, DUMP_U, &[]).await?;
    }
    Ok(())
}

/// A's insert (1, 'e2') meets B's rows (1, 'e1') and (2, 'e2'): on B it
/// collides with row 1 by the primary key and row 2 by the unique column.
/// `a_first`: A's insert is the older one and loses; else it wins.
async fn multiple_unique(prefix: &str, a_first: bool) -> Result<()> {
    let names = pair(prefix);
    let c = cluster(&[&names[0], &names[1]], U_SCHEMA, Res::Lww).await?;
    pause_both(&c).await?;
    let a_sql = "INSERT INTO u VALUES (1, 'e2', 'a')";
    let b_sql = "INSERT INTO u VALUES (1, 'e1', 'b'), (2, 'e2', 'b')";
    let (wa, wb) = if a_first {
        let wa = write(&c, 0, a_sql).await?;
        (wa, write(&c, 1, b_sql).await?)
    } else {
        let wb = write(&c, 1, b_sql).await?;
        (write(&c, 0, a_sql).await?, wb)
    };
    resume_both_and_sync(&c).await?;
    if a_first {
        // B's rows win everywhere. On A, B's row 1 replaces A's row 1 (same
        // key, B later); B's row 2 then collides with nothing.
        let want: &[&[&str]] = &[&["1", "e1", "b"], &["2", "e2", "b"]];
        assert_rows(&c, 0, DUMP_U, want).await?;
        assert_rows(&c, 1, DUMP_U, want).await?;
        assert_log(
            &c,
            0,
            vec![logged(
                "insert_exists",
                "public.u",
                r#"{"id": 1}"#,
                Some(&wa),
                &wb,
                "apply_remote",
            )],
        )
        .await?;
        assert_log(
            &c,
            1,
            vec![logged(
                "multiple_unique_conflicts",
                "public.u",
                r#"{"id": 1}"#,
                Some(&wb),
                &wa,
                "keep_local",
            )],
        )
        .await?;
    } else {
        // A's row wins everywhere: on B both colliding rows give way to it;
        // on A, B's two rows each lose to A's row 1.
        let want: &[&[&str]] = &[&["1", "e2", "a"]];
        assert_rows(&c, 0, DUMP_U, want).await?;
        assert_rows(&c, 1, DUMP_U, want).await?;
        assert_log(
            &c,
            0,
            vec![
                logged(
                    "insert_exists",
                    "public.u",
                    r#"{"id": 1}"#,
                    Some(&wa),
                    &wb,
                    "keep_local",
                ),
                logged(
                    "insert_exists",
                    "public.u",
                    r#"{"id": 2}"#,
                    Some(&wa),
                    &wb,
                    "keep_local",
                ),
            ],
        )
        .await?;
        assert_log(
            &c,
            1,
            vec![logged(
                "multiple_unique_conflicts",
                "public.u",
                r#"{"id": 1}"#,
                Some(&wb),
                &wa,
                "apply_remote",
            )],
        )
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_multiple_unique_conflicts_incoming_older() -> Result<()> {
    mm_tests::init_tracing();
    multiple_unique("lmo", true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lww_multiple_unique_conflicts_incoming_newer() -> Result<()> {
    mm_tests::init_tracing();
    multiple_unique("lmn", false).await
}

// ---------------------------------------------------------------------------
// first_writer_wins, apply_remote, keep_local: the main conflict types.
// apply_remote and keep_local do not converge by design; each node's own
// outcome is checked.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fww_insert_exists() -> Result<()> {
    mm_tests::init_tracing();
    insert_exists("fie", Res::Fww).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fww_update_origin_differs() -> Result<()> {
    mm_tests::init_tracing();
    update_origin_differs("fuo", Res::Fww).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fww_update_then_later_delete() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("fud", Res::Fww, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fww_delete_then_later_update() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("fdu", Res::Fww, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_insert_exists() -> Result<()> {
    mm_tests::init_tracing();
    insert_exists("aie", Res::ApplyRemote).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_update_origin_differs() -> Result<()> {
    mm_tests::init_tracing();
    update_origin_differs("auo", Res::ApplyRemote).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_update_then_later_delete() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("aud", Res::ApplyRemote, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_delete_then_later_update() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("adu", Res::ApplyRemote, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_local_insert_exists() -> Result<()> {
    mm_tests::init_tracing();
    insert_exists("kie", Res::KeepLocal).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_local_update_origin_differs() -> Result<()> {
    mm_tests::init_tracing();
    update_origin_differs("kuo", Res::KeepLocal).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_local_update_then_later_delete() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("kud", Res::KeepLocal, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_local_delete_then_later_update() -> Result<()> {
    mm_tests::init_tracing();
    update_vs_delete("kdu", Res::KeepLocal, true).await
}

// ---------------------------------------------------------------------------
// error: the stream stops at the transaction until `mmctl skip`.

/// The commit LSN an error message names ("... commit LSN 0/1A2B3C8 ...").
fn commit_lsn_in(err: &str) -> Result<String> {
    let at = err
        .find("LSN ")
        .with_context(|| format!("no LSN in error: {err}"))?;
    let lsn: String = err[at + 4..]
        .chars()
        .take_while(|ch| ch.is_ascii_hexdigit() || *ch == '/')
        .collect();
    parse_lsn(&lsn).with_context(|| format!("error: {err}"))?;
    Ok(lsn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_resolver_stops_the_stream_until_skip() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster_with(
        &["er1", "er2"],
        T_SCHEMA,
        "[conflicts.tables]\n\"public.t\" = \"error\"\n",
    )
    .await?;
    pause_both(&c).await?;
    let wa = write(&c, 0, "INSERT INTO t VALUES (1, 'a')").await?;
    write(&c, 1, "INSERT INTO t VALUES (10, 'before')").await?;
    let wb = write(&c, 1, "INSERT INTO t VALUES (1, 'b')").await?;
    write(&c, 1, "INSERT INTO t VALUES (11, 'after')").await?;
    c.resume("er1", "er2").await?;
    c.resume("er2", "er1").await?;

    // er2 -> er1 stops at B's conflicting transaction, naming the peer,
    // relation and conflict type; the one before it is applied, the one
    // after it is not (commit order).
    let timeout = Duration::from_secs(60);
    let s = c
        .wait_stream(
            "er2",
            "er1",
            "error",
            &["er2", "public.t", "insert_exists"],
            timeout,
        )
        .await?;
    let err = s["last_error"].as_str().unwrap_or_default().to_owned();
    ensure!(
        err.contains(r#""id""#) && err.contains("1"),
        "the error does not name the key: {err}"
    );
    let lsn_b = commit_lsn_in(&err)?;
    let l = parse_lsn(&lsn_b)?;
    ensure!(
        wb.lsn_lo < l && l <= wb.lsn_hi,
        "the error names LSN {lsn_b}, not the conflicting transaction's commit ({}..{}): {err}",
        fmt_lsn(wb.lsn_lo),
        fmt_lsn(wb.lsn_hi)
    );
    // And er1 -> er2 stops at A's insert.
    let s = c
        .wait_stream(
            "er1",
            "er2",
            "error",
            &["er1", "public.t", "insert_exists"],
            timeout,
        )
        .await?;
    let lsn_a = commit_lsn_in(s["last_error"].as_str().unwrap_or_default())?;
    let l = parse_lsn(&lsn_a)?;
    ensure!(wa.lsn_lo < l && l <= wa.lsn_hi, "er1's LSN {lsn_a}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A has B's transaction before the stuck one, not the one after it.
    assert_rows(&c, 0, DUMP_T, &[&["1", "a"], &["10", "before"]]).await?;
    assert_rows(
        &c,
        1,
        DUMP_T,
        &[&["1", "b"], &["10", "before"], &["11", "after"]],
    )
    .await?;
    // A stopped transaction leaves no conflict_log row (it rolled back).
    assert_log(&c, 0, vec![]).await?;
    assert_log(&c, 1, vec![]).await?;

    // `mmctl skip` on each node skips exactly that transaction; the ones
    // after it apply. (Needs `mmctl skip`: if this step fails with a usage
    // error, skip is not merged yet.)
    c.mmctl(0, &["skip", "--from", "er2", "--lsn", &lsn_b])
        .await?
        .ok()
        .context("mmctl skip on er1")?;
    c.mmctl(1, &["skip", "--from", "er1", "--lsn", &lsn_a])
        .await?
        .ok()
        .context("mmctl skip on er2")?;
    c.wait_sync(90).await?;
    assert_rows(
        &c,
        0,
        DUMP_T,
        &[&["1", "a"], &["10", "before"], &["11", "after"]],
    )
    .await?;
    assert_rows(
        &c,
        1,
        DUMP_T,
        &[&["1", "b"], &["10", "before"], &["11", "after"]],
    )
    .await?;
    for (i, from, lsn) in [(0, "er2", &lsn_b), (1, "er1", &lsn_a)] {
        let rows = c
            .rows(
                i,
                "SELECT conflict_type, relation, remote_origin, resolution, remote_lsn::text, \
                 remote_tuple::text FROM mm.conflict_log ORDER BY id",
            )
            .await?;
        // The audit row names the relation and the rows skipped (key 1).
        ensure!(
            rows.len() == 1
                && rows[0][..4] == row(&["skipped_transaction", "public.t", from, "skipped"])[..]
                && rows[0][5].as_deref()
                    == Some(
                        r#"{"rows": [{"op": "insert", "key": {"id": "1"}, "relation": "public.t"}], "changes": 1}"#
                    )
                && rows[0][4].as_deref().map(parse_lsn).transpose()? == Some(parse_lsn(lsn)?),
            "conflict log on {}: want one skipped_transaction from {from} at {lsn}, got {rows:?}",
            c.pg[i].name()
        );
        assert_eq!(
            c.rows(i, "SELECT count(*) FROM mm.skip_requests").await?,
            vec![row(&["0"])],
            "the skip request on node {i} was not consumed"
        );
    }
    for (from, to) in [("er1", "er2"), ("er2", "er1")] {
        let s = c.stream_status(from, to).await?;
        assert_eq!(s["state"].as_str(), Some("streaming"), "{s}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// sql:SCHEMA.FUNC: a counter that adds up concurrent increments.

const COUNTER_SCHEMA: &str = "
CREATE TABLE counters (id int PRIMARY KEY, n bigint NOT NULL);
-- The old row must carry n for the resolver to compute the increment.
ALTER TABLE counters REPLICA IDENTITY FULL;
CREATE SCHEMA app;
CREATE FUNCTION app.sum_counter(c jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
  IF jsonb_typeof(c->'local') IS DISTINCT FROM 'object' THEN
    RETURN c->'remote_new';
  END IF;
  IF jsonb_typeof(c->'remote_new') IS DISTINCT FROM 'object' THEN
    RETURN NULL;
  END IF;
  RETURN jsonb_set(c->'local', '{n}', to_jsonb(
    (c->'local'->>'n')::bigint + (c->'remote_new'->>'n')::bigint
      - coalesce((c->'remote_old'->>'n')::bigint, 0)));
END
$$;
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_resolver_sums_concurrent_increments() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster_with(
        &["sq1", "sq2"],
        COUNTER_SCHEMA,
        "[conflicts.tables]\n\"public.counters\" = \"sql:app.sum_counter\"\n",
    )
    .await?;
    seed(&c, "INSERT INTO counters VALUES (1, 10), (2, 100)").await?;
    pause_both(&c).await?;
    let wa = write(&c, 0, "UPDATE counters SET n = n + 5 WHERE id = 1").await?;
    let wb = write(
        &c,
        1,
        "UPDATE counters SET n = n + 7 WHERE id = 1; UPDATE counters SET n = n - 1 WHERE id = 2",
    )
    .await?;
    resume_both_and_sync(&c).await?;
    // 10 + 5 + 7 on both; row 2 had no conflict.
    let want: &[&[&str]] = &[&["1", "22"], &["2", "99"]];
    let dump = "SELECT id, n FROM counters ORDER BY id";
    assert_rows(&c, 0, dump, want).await?;
    assert_rows(&c, 1, dump, want).await?;
    let key = r#"{"id": 1}"#;
    assert_log(
        &c,
        0,
        vec![logged(
            "update_origin_differs",
            "public.counters",
            key,
            Some(&wa),
            &wb,
            "merged",
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "update_origin_differs",
            "public.counters",
            key,
            Some(&wb),
            &wa,
            "merged",
        )],
    )
    .await
}

// ---------------------------------------------------------------------------
// rust:NAME: a resolver registered by a binary embedding the agent.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_rust_resolver_max_value() -> Result<()> {
    mm_tests::init_tracing();
    let bin = mm_tests::agent::target_bin("mm-agent-custom", "MM_AGENT_CUSTOM_BIN")?;
    let c = TestCluster::start_opts(
        &["rs1", "rs2"],
        "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL);",
        ClusterOptions {
            agent_toml: "[conflicts.tables]\n\"public.t\" = \"rust:max_value\"\n".into(),
            agent_bin: Some(bin),
            ..ClusterOptions::default()
        },
    )
    .await?;
    seed(&c, "INSERT INTO t VALUES (2, 0)").await?;
    pause_both(&c).await?;
    // Key 1: A's larger value is the older write (last_writer_wins would
    // keep 20). Key 3: A's larger value is the newer one (first_writer_wins
    // would keep 70). Key 2: A's larger update is the older one.
    let wa1 = write(&c, 0, "INSERT INTO t VALUES (1, 50)").await?;
    let wb1 = write(&c, 1, "INSERT INTO t VALUES (1, 20)").await?;
    let wa2 = write(&c, 0, "UPDATE t SET v = 9 WHERE id = 2").await?;
    let wb2 = write(&c, 1, "UPDATE t SET v = 3 WHERE id = 2").await?;
    let wb3 = write(&c, 1, "INSERT INTO t VALUES (3, 70)").await?;
    let wa3 = write(&c, 0, "INSERT INTO t VALUES (3, 80)").await?;
    resume_both_and_sync(&c).await?;
    let want: &[&[&str]] = &[&["1", "50"], &["2", "9"], &["3", "80"]];
    assert_rows(&c, 0, DUMP_T, want).await?;
    assert_rows(&c, 1, DUMP_T, want).await?;
    let k = |i: i32| format!("{{\"id\": {i}}}");
    assert_log(
        &c,
        0,
        vec![
            logged(
                "insert_exists",
                "public.t",
                &k(1),
                Some(&wa1),
                &wb1,
                "keep_local",
            ),
            logged(
                "update_origin_differs",
                "public.t",
                &k(2),
                Some(&wa2),
                &wb2,
                "keep_local",
            ),
            logged(
                "insert_exists",
                "public.t",
                &k(3),
                Some(&wa3),
                &wb3,
                "keep_local",
            ),
        ],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![
            logged(
                "insert_exists",
                "public.t",
                &k(1),
                Some(&wb1),
                &wa1,
                "apply_remote",
            ),
            logged(
                "update_origin_differs",
                "public.t",
                &k(2),
                Some(&wb2),
                &wa2,
                "apply_remote",
            ),
            logged(
                "insert_exists",
                "public.t",
                &k(3),
                Some(&wb3),
                &wa3,
                "apply_remote",
            ),
        ],
    )
    .await
}

// ---------------------------------------------------------------------------
// Three nodes: changes arriving out of order through different paths.

/// C inserts rows 1 and 2; B (which received them) updates row 1 and
/// deletes row 2 while C -> A is paused. A gets B's changes first
/// (update_missing -> insert of B's full row; delete_missing -> tombstone),
/// then C's older inserts, which lose to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_late_insert_loses_to_newer_update_and_delete() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["tn1", "tn2", "tn3"], T_SCHEMA, Res::Lww).await?;
    c.pause("tn3", "tn1").await?;
    let wc = write(&c, 2, "INSERT INTO t VALUES (1, 'c'), (2, 'c2')").await?;
    c.wait_for(1, "SELECT count(*) FROM t", "2", Duration::from_secs(30))
        .await?;
    tokio::time::sleep(WATERMARK_SETTLE).await;
    let wb1 = write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 1").await?;
    let wb2 = write(&c, 1, "DELETE FROM t WHERE id = 2").await?;
    c.wait_for(
        0,
        "SELECT v FROM t WHERE id = 1",
        "b",
        Duration::from_secs(30),
    )
    .await?;
    c.wait_sync_ignore_paused(60).await?;
    assert_rows(&c, 0, DUMP_T, &[&["1", "b"]]).await?;
    c.resume("tn3", "tn1").await?;
    c.wait_sync(90).await?;

    for i in 0..3 {
        assert_rows(&c, i, DUMP_T, &[&["1", "b"]]).await?;
    }
    assert_eq!(row_ts(&c, 0, "t", 1).await?, Some(wb1.ts.clone()));
    let k = |i: i32| format!("{{\"id\": {i}}}");
    assert_log(
        &c,
        0,
        vec![
            logged(
                "update_missing",
                "public.t",
                &k(1),
                None,
                &wb1,
                "apply_remote",
            ),
            logged(
                "delete_missing",
                "public.t",
                &k(2),
                None,
                &wb2,
                "apply_remote",
            ),
            logged(
                "insert_exists",
                "public.t",
                &k(1),
                Some(&wb1),
                &wc,
                "keep_local",
            ),
            // The row is gone: its tombstone (B's delete) is the local version.
            logged(
                "insert_exists",
                "public.t",
                &k(2),
                Some(&wb2),
                &wc,
                "keep_local",
            ),
        ],
    )
    .await?;
    // B and C saw everything in order: nothing to resolve, and on C B's
    // changes to C's rows were routine.
    assert_log(&c, 1, vec![]).await?;
    assert_log(&c, 2, vec![]).await?;
    let routine = wait_routine(&c, "tn2", "tn3", 2).await?;
    assert!(
        routine >= Some(2),
        "tn2 -> tn3 should count B's update and delete of C's rows as routine: {routine:?}"
    );
    Ok(())
}

const DOC_SCHEMA: &str = "
CREATE TABLE doc (id int PRIMARY KEY, big text, v text);
ALTER TABLE doc ALTER COLUMN big SET STORAGE EXTERNAL;
";

/// md5 chains of `n` rounds: 32·n bytes, stored out of line (> 2 kB).
fn big_sql(n: u32, salt: &str) -> String {
    format!(
        "(SELECT string_agg(md5(g::text || '{salt}'), '' ORDER BY g) FROM generate_series(1, {n}) g)"
    )
}

const DUMP_DOC: &str = "SELECT id, md5(big), length(big), v FROM doc ORDER BY id";

async fn doc_md5(c: &TestCluster, n: u32, salt: &str) -> Result<Option<String>> {
    c.pg[0]
        .query_one_string(&format!("SELECT md5({})", big_sql(n, salt)))
        .await
}

/// As above, but B's update leaves a TOASTed column unchanged, so it
/// arrives at A without that value while A does not have the row: A must
/// not write NULL, and need not wait for C's insert either: it reads the
/// value from B (B's row is that update's version) and converges at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_unchanged_toast_reads_the_row_from_its_origin() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["to1", "to2", "to3"], DOC_SCHEMA, Res::Lww).await?;
    c.pause("to3", "to1").await?;
    write(
        &c,
        2,
        &format!("INSERT INTO doc SELECT 1, {}, 'c'", big_sql(200, "")),
    )
    .await?;
    c.wait_for(1, "SELECT count(*) FROM doc", "1", Duration::from_secs(30))
        .await?;
    tokio::time::sleep(WATERMARK_SETTLE).await;
    write(&c, 1, "UPDATE doc SET v = 'b' WHERE id = 1").await?;
    // A gets B's update while C -> A is still paused.
    c.wait_for(
        0,
        "SELECT v FROM doc WHERE id = 1",
        "b",
        Duration::from_secs(30),
    )
    .await?;
    let want_md5 = doc_md5(&c, 200, "").await?;
    let want = vec![vec![
        Some("1".into()),
        want_md5.clone(),
        Some("6400".into()),
        Some("b".into()),
    ]];
    ensure!(
        c.rows(0, DUMP_DOC).await? == want,
        "A before C's insert arrives"
    );
    c.resume("to3", "to1").await?;
    c.wait_sync(120).await?;
    ensure!(c.assert_same(DUMP_DOC).await? == want);
    Ok(())
}

/// Two nodes, B changes the TOASTed column, A later another column: A's
/// row wins everywhere, whole, including the TOASTed value B no longer
/// holds (read from A).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_unchanged_toast_in_an_update_conflict() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["tu1", "tu2"], DOC_SCHEMA, Res::Lww).await?;
    seed(
        &c,
        &format!("INSERT INTO doc SELECT 1, {}, 'init'", big_sql(200, "old")),
    )
    .await?;
    pause_both(&c).await?;
    write(
        &c,
        1,
        &format!("UPDATE doc SET big = {} WHERE id = 1", big_sql(300, "new")),
    )
    .await?;
    write(&c, 0, "UPDATE doc SET v = 'a' WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;
    ensure_a_row_everywhere(&c).await
}

/// A's row everywhere, whole: the seed's TOASTed value, `v = 'a'`.
async fn ensure_a_row_everywhere(c: &TestCluster) -> Result<()> {
    let want = vec![vec![
        Some("1".into()),
        doc_md5(c, 200, "old").await?,
        Some("6400".into()),
        Some("a".into()),
    ]];
    ensure!(
        c.assert_same(DUMP_DOC).await? == want,
        "want A's row everywhere, with the TOASTed value A has"
    );
    Ok(())
}

/// A watermark is the newest commit timestamp a publisher applied from an
/// origin, and an origin's commit timestamps run slightly out of its commit
/// order: the publisher may announce a watermark past a version it has not
/// applied. Here A's announcement says so by hand, as such a reordering
/// would, only wider (half a second past B's version). B changes the
/// TOASTed column, A (without B's change) another one, later. Taken at its
/// word, the watermark makes A's update routine on B, and B would keep its
/// own TOASTed value under A's winning row, which A does not have. Within
/// the order margin B must take the row from A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_unchanged_toast_watermark_past_an_unapplied_version() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["tw1", "tw2"], DOC_SCHEMA, Res::Lww).await?;
    seed(
        &c,
        &format!("INSERT INTO doc SELECT 1, {}, 'init'", big_sql(200, "old")),
    )
    .await?;
    c.pause("tw2", "tw1").await?;
    let b = write(
        &c,
        1,
        &format!("UPDATE doc SET big = {} WHERE id = 1", big_sql(300, "new")),
    )
    .await?;
    // The announcement and the update in one transaction: no real
    // announcement of A's can come between them.
    write(
        &c,
        0,
        &format!(
            "DO $w$ BEGIN PERFORM pg_logical_emit_message(false, 'mm.watermark', \
             jsonb_build_object('node', 'tw1', 'applied', \
             jsonb_build_object('tw2', '{} UTC'::timestamptz + interval '500 ms'))::text); END $w$; \
             UPDATE doc SET v = 'a' WHERE id = 1",
            b.ts
        ),
    )
    .await?;
    c.wait_for(
        1,
        "SELECT v FROM doc WHERE id = 1",
        "a",
        Duration::from_secs(30),
    )
    .await?;
    c.resume("tw2", "tw1").await?;
    c.wait_sync(90).await?;
    ensure_a_row_everywhere(&c).await
}

/// Two nodes, B deletes the row, A later updates another column: the
/// update wins (newer), so the row comes back on B whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_unchanged_toast_update_after_delete() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["td1", "td2"], DOC_SCHEMA, Res::Lww).await?;
    seed(
        &c,
        &format!("INSERT INTO doc SELECT 1, {}, 'init'", big_sql(200, "x")),
    )
    .await?;
    pause_both(&c).await?;
    write(&c, 1, "DELETE FROM doc WHERE id = 1").await?;
    write(&c, 0, "UPDATE doc SET v = 'a' WHERE id = 1").await?;
    resume_both_and_sync(&c).await?;
    let want = vec![vec![
        Some("1".into()),
        doc_md5(&c, 200, "x").await?,
        Some("6400".into()),
        Some("a".into()),
    ]];
    ensure!(
        c.assert_same(DUMP_DOC).await? == want,
        "want A's row everywhere"
    );
    let logged = c
        .rows(
            1,
            "SELECT conflict_type, resolution, length(remote_tuple->>'big') FROM mm.conflict_log",
        )
        .await?;
    ensure!(
        logged == vec![row(&["update_deleted", "apply_remote", "6400"])],
        "B's log (the resolver saw the whole row): {logged:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// True conflicts vs routine cross-origin changes.

/// A change to a row another node wrote, made after this node had seen
/// that row, is routine: applied, counted, not logged. Concurrent updates
/// are true conflicts: exactly one log row per node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routine_changes_are_not_conflicts() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["rt1", "rt2"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'from A')").await?;
    write(&c, 1, "UPDATE t SET v = 'B saw it' WHERE id = 1").await?;
    write(&c, 1, "DELETE FROM t WHERE id = 1").await?;
    write(&c, 1, "INSERT INTO t VALUES (2, 'from B')").await?;
    c.wait_sync(60).await?;
    tokio::time::sleep(WATERMARK_SETTLE).await;
    write(&c, 0, "UPDATE t SET v = 'A saw it' WHERE id = 2").await?;
    c.wait_sync(60).await?;
    let want: &[&[&str]] = &[&["2", "A saw it"]];
    assert_rows(&c, 0, DUMP_T, want).await?;
    assert_rows(&c, 1, DUMP_T, want).await?;
    assert_log(&c, 0, vec![]).await?;
    assert_log(&c, 1, vec![]).await?;
    let on_a = wait_routine(&c, "rt2", "rt1", 1).await?;
    assert!(
        on_a >= Some(1),
        "rt2 -> rt1: B's update of A's row is routine: {on_a:?}"
    );
    let on_b = wait_routine(&c, "rt1", "rt2", 1).await?;
    assert!(
        on_b >= Some(1),
        "rt1 -> rt2: A's update of B's row is routine: {on_b:?}"
    );

    pause_both(&c).await?;
    let wa = write(&c, 0, "UPDATE t SET v = 'a' WHERE id = 2").await?;
    let wb = write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 2").await?;
    resume_both_and_sync(&c).await?;
    let want: &[&[&str]] = &[&["2", "b"]];
    assert_rows(&c, 0, DUMP_T, want).await?;
    assert_rows(&c, 1, DUMP_T, want).await?;
    let key = r#"{"id": 2}"#;
    assert_log(
        &c,
        0,
        vec![logged(
            "update_origin_differs",
            "public.t",
            key,
            Some(&wa),
            &wb,
            "apply_remote",
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "update_origin_differs",
            "public.t",
            key,
            Some(&wb),
            &wa,
            "keep_local",
        )],
    )
    .await?;
    // The conflicts are counted per type in status.
    let count = |s: serde_json::Value| s["conflicts"]["update_origin_differs"].as_u64();
    assert_eq!(count(c.stream_status("rt2", "rt1").await?), Some(1));
    assert_eq!(count(c.stream_status("rt1", "rt2").await?), Some(1));
    Ok(())
}

/// What a publisher had seen must survive a restart of the stream: B's
/// updates to rows it had received are routine however the stream into A
/// was interrupted just before them (paused and resumed; A's agent killed
/// and restarted). The publisher's watermark announcements that preceded
/// the interruption are not sent again (the slot resumes past them), so the
/// receiving side has to keep what it had learnt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routine_survives_a_stream_restart() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = cluster(&["rr1", "rr2"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'from A'), (2, 'from A')").await?;

    c.pause("rr2", "rr1").await?;
    write(&c, 1, "UPDATE t SET v = 'B after pause' WHERE id = 1").await?;
    c.resume("rr2", "rr1").await?;
    c.wait_sync(60).await?;
    assert_rows(&c, 0, DUMP_T, &[&["1", "B after pause"], &["2", "from A"]]).await?;
    assert_log(&c, 0, vec![])
        .await
        .context("after pause/resume of rr2 -> rr1")?;

    c.agents[0].kill9()?;
    write(&c, 1, "UPDATE t SET v = 'B while A is down' WHERE id = 2").await?;
    c.agents[0].start()?;
    c.agents[0].wait_ready(Duration::from_secs(30)).await?;
    c.wait_sync(60).await?;
    assert_rows(
        &c,
        0,
        DUMP_T,
        &[&["1", "B after pause"], &["2", "B while A is down"]],
    )
    .await?;
    assert_log(&c, 0, vec![])
        .await
        .context("after kill -9 and restart of rr1's agent")?;
    assert_log(&c, 1, vec![]).await?;
    Ok(())
}

/// A's local delete leaves a tombstone: B's older update, held back by the
/// pause, arrives after the delete and must not bring the row back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_delete_tombstone_beats_an_older_update() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["ld1", "ld2"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'init'), (2, 'keep')").await?;
    c.pause("ld2", "ld1").await?;
    let wb = write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 1").await?;
    let wa = write(&c, 0, "DELETE FROM t WHERE id = 1").await?;
    // A's delete reaches B (not paused) and wins there.
    c.wait_for(
        1,
        "SELECT count(*) FROM t WHERE id = 1",
        "0",
        Duration::from_secs(30),
    )
    .await?;
    c.resume("ld2", "ld1").await?;
    c.wait_sync(90).await?;
    let want: &[&[&str]] = &[&["2", "keep"]];
    assert_rows(&c, 0, DUMP_T, want).await?;
    assert_rows(&c, 1, DUMP_T, want).await?;
    let key = r#"{"id": 1}"#;
    assert_log(
        &c,
        0,
        vec![logged(
            "update_deleted",
            "public.t",
            key,
            Some(&wa),
            &wb,
            "keep_local",
        )],
    )
    .await?;
    assert_log(
        &c,
        1,
        vec![logged(
            "delete_origin_differs",
            "public.t",
            key,
            Some(&wb),
            &wa,
            "apply_remote",
        )],
    )
    .await
}

// ---------------------------------------------------------------------------
// Two streams into one node, racing for one key.

/// Streams from different peers apply in parallel sessions. Here A's and
/// B's inserts of key 100 reach C at the same moment, B's inside a careful
/// (resolver) transaction: B judges key 100 free while A's insert is not yet
/// committed, and its insert waits on A's. When A commits, B's insert fails
/// with a unique violation that says nothing about the change itself; the
/// stream must judge its transaction again (now against A's row) instead of
/// stopping there for ever.
///
/// Made deterministic with one row lock: A's transaction also updates row 1,
/// which a session on C holds `FOR UPDATE` until B's insert waits behind A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streams_racing_for_one_key_in_the_careful_path_converge() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["rk1", "rk2", "rk3"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'seed'), (2, 'seed')").await?;
    for (from, to) in [
        ("rk1", "rk3"),
        ("rk2", "rk3"),
        ("rk1", "rk2"),
        ("rk2", "rk1"),
    ] {
        c.pause(from, to).await?;
    }
    // Row 2 changed on C: B's update of it is a conflict there (careful path).
    write(&c, 2, "UPDATE t SET v = 'c' WHERE id = 2").await?;
    // A: the insert first, then a routine update that will wait on C's lock.
    write(
        &c,
        0,
        "INSERT INTO t VALUES (100, 'a'); UPDATE t SET v = 'a' WHERE id = 1",
    )
    .await?;
    // B: the conflict first (careful), then the insert of the same key.
    write(
        &c,
        1,
        "UPDATE t SET v = 'b' WHERE id = 2; INSERT INTO t VALUES (100, 'b')",
    )
    .await?;

    let holder = hold_open(&c, 2, "SELECT * FROM t WHERE id = 1 FOR UPDATE").await?;
    c.resume("rk1", "rk3").await?;
    // A's transaction now holds key 100 uncommitted and waits on row 1.
    let watcher = c.pg[2].connect().await?;
    ensure!(
        poll_for(&watcher, ROW_WAITS, "1", Duration::from_secs(60)).await?,
        "A's transaction never waited on the lock"
    );
    c.resume("rk2", "rk3").await?;
    // B's careful transaction waits for A's: in the agent, for the gate
    // between fast-path and careful transactions (nothing to see in
    // pg_locks), or, were that gone, in PostgreSQL behind A's key 100.
    let _ = poll_for(&watcher, ROW_WAITS, "2", Duration::from_secs(3)).await?;
    holder.batch_execute("COMMIT").await?;
    c.resume("rk1", "rk2").await?;
    c.resume("rk2", "rk1").await?;
    c.wait_sync(90).await?;

    // B's insert is the later one: it wins on every node.
    for i in 0..3 {
        assert_rows(&c, i, DUMP_T, &[&["1", "a"], &["2", "b"], &["100", "b"]]).await?;
    }
    let kinds = conflict_log(&c, 2).await?;
    ensure!(
        kinds
            .iter()
            .any(|(l, _)| l.ty == "insert_exists" && l.key.as_deref() == Some(r#"{"id": 100}"#)),
        "C logged no insert_exists for key 100: {kinds:?}"
    );
    Ok(())
}

/// Two careful (resolver) transactions from different peers on one key at
/// once. C holds no row 7 and an old tombstone for it (its own delete). A's
/// later delete of row 7 reaches C in the careful path (nothing to delete:
/// the tombstone is raised to A's version) and, before it commits, B's update
/// of row 7 (older than A's delete) arrives in another session. Judged
/// against the tombstone as committed before A's, the update would win and
/// bring row 7 back on C only; judged after A's transaction (one careful
/// transaction at a time per node), it loses, as on A and B.
///
/// A's transaction also updates row 1, which a session on C holds
/// `FOR UPDATE`, to keep it open while B's arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_careful_transactions_on_one_key_are_judged_one_after_the_other() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["ck1", "ck2", "ck3"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'seed'), (7, 'seed')").await?;
    for (from, to) in [
        ("ck1", "ck3"),
        ("ck2", "ck3"),
        ("ck1", "ck2"),
        ("ck2", "ck1"),
        ("ck3", "ck1"),
        ("ck3", "ck2"),
    ] {
        c.pause(from, to).await?;
    }
    write(&c, 2, "DELETE FROM t WHERE id = 7").await?;
    write(&c, 1, "UPDATE t SET v = 'b' WHERE id = 7").await?;
    write(
        &c,
        0,
        "DELETE FROM t WHERE id = 7; UPDATE t SET v = 'a' WHERE id = 1",
    )
    .await?;

    let holder = hold_open(&c, 2, "SELECT * FROM t WHERE id = 1 FOR UPDATE").await?;
    c.resume("ck1", "ck3").await?;
    let watcher = c.pg[2].connect().await?;
    ensure!(
        poll_for(&watcher, ROW_WAITS, "1", Duration::from_secs(60)).await?,
        "A's transaction never waited on the lock"
    );
    c.resume("ck2", "ck3").await?;
    // Either B's transaction waits for A's (the rule), or it commits at
    // once and row 7 is back (the divergence this test is about).
    // The careful lock is advisory lock 30800818464715365 (classid, objid:
    // its high and low 32 bits).
    let settled = "SELECT (EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted AND locktype = 'advisory' \
                   AND classid = 7171374 AND objid = 1667330661) \
                   OR EXISTS (SELECT 1 FROM t WHERE id = 7))::text";
    // It may also wait in the agent, for the gate all careful transactions
    // take (`apply/gate.rs`), which pg_locks does not show: give it time.
    let _ = poll_for(&watcher, settled, "true", Duration::from_secs(3)).await?;
    holder.batch_execute("COMMIT").await?;
    for (from, to) in [
        ("ck1", "ck2"),
        ("ck2", "ck1"),
        ("ck3", "ck1"),
        ("ck3", "ck2"),
    ] {
        c.resume(from, to).await?;
    }
    c.wait_sync(90).await?;

    // A's delete is the newest change to row 7: gone everywhere.
    for i in 0..3 {
        assert_rows(&c, i, DUMP_T, &[&["1", "a"]]).await?;
    }
    Ok(())
}

/// Issue 9, race (b): a fast-path INSERT of a key whose old row a local
/// transaction is deleting. The insert waits at the key's index entry for
/// the deleter; once that commits the old row is dead and the insert goes
/// in, although the delete (and the tombstone it left) is newer than the
/// insert. The insert's own tombstone check ran before the wait, under its
/// statement snapshot.
///
/// Here: C inserts key 5 ('c'), A later inserts key 5 ('a'), neither sees
/// the other's (paused). A session on C deletes key 5 and holds the delete
/// open until A's insert waits on it. C's delete is the newest change: key 5
/// must end gone on both nodes. Before the re-check (`mm.insert_recheck`),
/// C kept A's row and A had none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_waiting_on_a_local_delete_of_its_key_loses_to_it() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["wd1", "wd2"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'seed')").await?;
    pause_both(&c).await?;
    write(&c, 1, "INSERT INTO t VALUES (5, 'c')").await?;
    write(&c, 0, "INSERT INTO t VALUES (5, 'a')").await?;

    let holder = hold_open(&c, 1, "DELETE FROM t WHERE id = 5").await?;
    c.resume("wd1", "wd2").await?;
    let watcher = c.pg[1].connect().await?;
    ensure!(
        poll_for(&watcher, ROW_WAITS, "1", Duration::from_secs(60)).await?,
        "A's insert never waited on C's delete"
    );
    holder.batch_execute("COMMIT").await?;
    c.resume("wd2", "wd1").await?;
    c.wait_sync(90).await?;
    for i in 0..2 {
        assert_rows(&c, i, DUMP_T, &[&["1", "seed"]]).await?;
    }
    Ok(())
}

/// Issue 9, race (a): a careful transaction raising a key's tombstone while
/// another stream's fast-path INSERT of that key is uncommitted. Neither
/// sees the other's work; without the gate between them (`apply/gate.rs`)
/// both committed and the key stayed on this node only.
///
/// A inserts key 5 and updates row 1 in one transaction; a session on C
/// holds row 1, so on C that transaction waits with key 5 inserted. B,
/// which has A's row, deletes key 5: on C the row is not visible, the delete
/// goes to the careful path (delete_missing) and raises key 5's tombstone.
/// B's delete is the newest change to key 5: gone everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_careful_delete_waits_for_a_concurrent_fast_insert_of_its_key() -> Result<()> {
    mm_tests::init_tracing();
    let c = cluster(&["gi1", "gi2", "gi3"], T_SCHEMA, Res::Lww).await?;
    seed(&c, "INSERT INTO t VALUES (1, 'seed')").await?;
    let holder = hold_open(&c, 2, "SELECT * FROM t WHERE id = 1 FOR UPDATE").await?;
    write(
        &c,
        0,
        "INSERT INTO t VALUES (5, 'a'); UPDATE t SET v = 'a' WHERE id = 1",
    )
    .await?;
    let watcher = c.pg[2].connect().await?;
    ensure!(
        poll_for(&watcher, ROW_WAITS, "1", Duration::from_secs(60)).await?,
        "A's transaction never waited on C's lock"
    );
    let b = c.pg[1].connect().await?;
    ensure!(
        poll_for(
            &b,
            "SELECT count(*)::text FROM t WHERE id = 5",
            "1",
            Duration::from_secs(60)
        )
        .await?,
        "B never received A's row"
    );
    tokio::time::sleep(WATERMARK_SETTLE).await;
    write(&c, 1, "DELETE FROM t WHERE id = 5").await?;
    // Without the gate, C commits B's delete (and its tombstone) at once.
    let tombstoned = "SELECT (count(*) > 0)::text FROM mm.tombstones \
                      WHERE key = '{\"id\": 5}'::jsonb";
    let _ = poll_for(&watcher, tombstoned, "true", Duration::from_secs(4)).await?;
    holder.batch_execute("COMMIT").await?;
    c.wait_sync(90).await?;
    for i in 0..3 {
        assert_rows(&c, i, DUMP_T, &[&["1", "a"]]).await?;
    }
    Ok(())
}
