//! Grouped apply (`replication.group_transactions`, `apply/group.rs`): a
//! backlog of small transactions is applied as few local transactions,
//! each remote one still exactly once, in order and atomically; a conflict
//! inside a group is resolved once, as without groups; an error inside a
//! group names the transaction that failed, and nothing after it commits;
//! with a third node this node has not heard from lately, transactions are
//! not grouped (their rows' version stamps could be judged differently by
//! that node's later changes); and by default nothing is grouped, so every
//! row keeps its origin's commit timestamp on every node.
//!
//! Grouping shows in the subscriber's rows: rows written by one local
//! transaction share its xmin.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use mm_tests::TestCluster;
use mm_tests::cluster::ClusterOptions;

const SCHEMA: &str = "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL);";
/// Appended to the agents' `[replication]` section.
const GROUPS: &str = "group_transactions = 100\n";

async fn grouping(names: &[&str], more_toml: &str) -> Result<TestCluster> {
    TestCluster::start_opts(
        names,
        SCHEMA,
        ClusterOptions {
            agent_toml: format!("{GROUPS}{more_toml}"),
            ..ClusterOptions::default()
        },
    )
    .await
}

/// `n` single-row INSERT transactions of ids `from..from+n`.
fn inserts(from: i32, n: i32) -> Vec<String> {
    (from..from + n)
        .map(|id| format!("INSERT INTO items VALUES ({id}, {id})"))
        .collect()
}

fn applied_txns(status: &serde_json::Value) -> u64 {
    status
        .get("applied_txns")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

/// 3000 single-row transactions (inserts, then updates and deletes of
/// some of those rows) wait behind a paused stream; two of the inserted
/// keys were written on the subscriber earlier. After resuming: identical
/// nodes with the publisher's newer rows, exactly two conflicts, every
/// transaction counted once, and far fewer local transactions than
/// remote ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_small_transactions_is_applied_in_groups_exactly_once() -> Result<()> {
    mm_tests::init_tracing();
    let c = grouping(&["grp1", "grp2"], "").await?;
    let rows = c.a_backlog_with_two_conflicts("grp1", "grp2").await?;
    // Grouped: 1601 rows, few local transactions wrote them.
    let xids = c
        .value(1, "SELECT count(DISTINCT xmin::text) FROM items")
        .await?;
    ensure!(
        xids * 5 < rows.len() as i64,
        "{xids} local transactions wrote {} rows: not grouped",
        rows.len()
    );
    Ok(())
}

/// With a third node whose agent is down, its changes may still be on
/// their way: a backlog from the first node is applied one local
/// transaction per remote one (in batches, each committed on its own). Once the third node is back and heard
/// from, the next backlog is grouped again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_third_node_keeps_transactions_apart() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = grouping(&["gsl1", "gsl2", "gsl3"], "").await?;
    c.agents[2].stop()?;
    c.pause("gsl1", "gsl2").await?;
    c.run_each(0, &inserts(1, 500)).await?;
    c.resume("gsl1", "gsl2").await?;
    let long = Duration::from_secs(60);
    c.wait_for(1, "SELECT count(*) FROM items", "500", long)
        .await?;
    let xids = c
        .value(1, "SELECT count(DISTINCT xmin::text) FROM items")
        .await?;
    ensure!(
        xids == 500,
        "{xids} local transactions applied 500 while gsl3 was silent"
    );
    // Apart, but not one statement each: batches commit each on its own.
    ensure!(
        c.batch_procedures(1).await? >= 1,
        "transactions the groups refused were not batched"
    );

    c.agents[2].start()?;
    c.agents[2].wait_ready(long).await?;
    c.wait_sync(120).await?;
    c.pause("gsl1", "gsl2").await?;
    c.run_each(0, &inserts(501, 500)).await?;
    // gsl3 announces within 2 s what it applied (gsl1's rows, and gsl1's
    // clock through gsl1's announcements); grouping needs that past the
    // backlog by the order margin (1 s) on both counts.
    tokio::time::sleep(Duration::from_secs(8)).await;
    c.resume("gsl1", "gsl2").await?;
    c.wait_for(1, "SELECT count(*) FROM items", "1000", long)
        .await?;
    let xids = c
        .value(
            1,
            "SELECT count(DISTINCT xmin::text) FROM items WHERE id > 500",
        )
        .await?;
    ensure!(
        xids * 5 < 500,
        "{xids} local transactions applied 500 with every node heard from"
    );
    c.wait_sync(120).await?;
    c.assert_same("SELECT id, v FROM items ORDER BY id").await?;
    Ok(())
}

/// A CHECK constraint only the subscriber has stops the stream at the
/// row that violates it. In a group that statement is several
/// transactions' (merged inserts): the error must still name the failed
/// transaction, those before it must be applied and none after it; once
/// the constraint is fixed, everything is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_in_a_group_names_its_transaction_and_nothing_after_it_commits() -> Result<()> {
    mm_tests::init_tracing();
    let c = grouping(&["gerr1", "gerr2"], "").await?;
    c.an_error_in_a_backlog_names_its_transaction("gerr1", "gerr2")
        .await
}

/// By default (`group_transactions = 1`) every remote transaction is a
/// local transaction of its own, and every row carries its origin's
/// commit timestamp on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_nothing_is_grouped_and_row_versions_match() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["gdf1", "gdf2"], SCHEMA).await?;
    c.pause("gdf1", "gdf2").await?;
    c.run_each(0, &inserts(1, 300)).await?;
    c.resume("gdf1", "gdf2").await?;
    c.wait_sync(60).await?;
    let xids = c
        .value(1, "SELECT count(DISTINCT xmin::text) FROM items")
        .await?;
    ensure!(xids == 300, "{xids} local transactions applied 300");
    c.assert_same(
        "SELECT id, pg_catalog.pg_xact_commit_timestamp(xmin)::text FROM items ORDER BY id",
    )
    .await
    .context("row versions differ")?;
    Ok(())
}

/// A table and columns named like the merged statements' own aliases and
/// columns (`sql::fast_update_many`, `fast_delete_many`): a user's name
/// must not capture one of ours.
const HOSTILE: &str = r#"CREATE TABLE "mm_v" (id numeric PRIMARY KEY, "mm_1" int NOT NULL, "mm_ts" text NOT NULL, u int);
CREATE TABLE "mm_t" ("d" int PRIMARY KEY, "mm_v" numeric NOT NULL, "xmin_" text);"#;

/// A group's row changes go out as one statement per table and kind
/// (`apply/merge.rs`), moved ahead of earlier ones only where they
/// commute. A backlog mixing an update of one table and an insert into
/// another per transaction, a key updated again and again, a key deleted
/// and inserted again, and one key spelled two ways (`1000.0`, `1000.00`,
/// which only the replay one transaction at a time can tell apart: a table
/// with a unique index besides its key is never reordered, `merge.rs`):
/// the nodes end identical, with
/// the publisher's final values, no conflict, every transaction counted
/// once, and the updates of a hundred transactions written by one
/// statement (rows written by one statement share xmin and cmin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_groups_changes_are_merged_per_table_and_keep_commit_order() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start_opts(
        &["gmg1", "gmg2"],
        HOSTILE,
        ClusterOptions {
            agent_toml: GROUPS.to_owned(),
            ..ClusterOptions::default()
        },
    )
    .await?;
    c.pause("gmg1", "gmg2").await?;
    let before = applied_txns(&c.stream_status("gmg1", "gmg2").await?);
    let mut stmts: Vec<String> = (1..=300)
        .map(|k| format!(r#"INSERT INTO "mm_v" VALUES ({k}, 0, 'a', {k})"#))
        .collect();
    stmts.extend((1..=300).map(|k| {
        format!(
            r#"UPDATE "mm_v" SET "mm_1" = {k}, "mm_ts" = 'b{k}' WHERE id = {k}; INSERT INTO "mm_t" VALUES ({k}, {k}, 'h')"#
        )
    }));
    for j in 0..40 {
        stmts.push(r#"UPDATE "mm_v" SET "mm_1" = "mm_1" + 1 WHERE id = 5"#.to_owned());
        stmts.push(format!(
            r#"UPDATE "mm_v" SET "mm_1" = "mm_1" + 1 WHERE id = {}"#,
            100 + j
        ));
    }
    for s in [
        r#"DELETE FROM "mm_v" WHERE id = 10"#,
        r#"INSERT INTO "mm_v" VALUES (10, 99, 'c', 10)"#,
        r#"DELETE FROM "mm_t" WHERE "d" = 20"#,
        r#"INSERT INTO "mm_t" VALUES (20, 1, 'again')"#,
        r#"INSERT INTO "mm_v" VALUES (1000.0, 1, 'n', 1000)"#,
        r#"DELETE FROM "mm_v" WHERE id = 1000"#,
        r#"INSERT INTO "mm_v" VALUES (1000.00, 2, 'n2', 1000)"#,
        r#"UPDATE "mm_v" SET u = 100000 WHERE id = 1"#,
        r#"UPDATE "mm_v" SET u = 1 WHERE id = 2"#,
        r#"UPDATE "mm_v" SET u = 2 WHERE id = 1"#,
    ] {
        stmts.push(s.to_owned());
    }
    for k in 200..=260 {
        stmts.push(format!(r#"DELETE FROM "mm_t" WHERE "d" = {k}"#));
        stmts.push(format!(r#"DELETE FROM "mm_v" WHERE id = {k}"#));
    }
    c.run_each(0, &stmts).await?;
    c.resume("gmg1", "gmg2").await?;
    c.wait_sync(120).await?;

    let rows = c
        .assert_same(r#"SELECT id::text, "mm_1", "mm_ts", u FROM "mm_v" ORDER BY id"#)
        .await?;
    ensure!(rows.len() == 240, "{} rows in mm_v", rows.len());
    c.assert_same(r#"SELECT "d", "mm_v"::text, "xmin_" FROM "mm_t" ORDER BY "d""#)
        .await?;
    let want = [
        (r#"SELECT "mm_1" FROM "mm_v" WHERE id = 5"#, 45),
        (r#"SELECT "mm_1" FROM "mm_v" WHERE id = 139"#, 140),
        (r#"SELECT "mm_1" FROM "mm_v" WHERE id = 10"#, 99),
        (r#"SELECT "mm_1" FROM "mm_v" WHERE id = 1000"#, 2),
        (r#"SELECT u FROM "mm_v" WHERE id = 1"#, 2),
        (r#"SELECT u FROM "mm_v" WHERE id = 2"#, 1),
        (r#"SELECT count(*) FROM "mm_t""#, 239),
        (r#"SELECT "mm_v" FROM "mm_t" WHERE "d" = 20"#, 1),
    ];
    for (sql, v) in want {
        let got = c.value(1, sql).await?;
        ensure!(got == v, "{sql}: {got}, want {v}");
    }
    let spelled = c
        .rows(1, r#"SELECT id::text FROM "mm_v" WHERE id = 1000"#)
        .await?;
    ensure!(
        spelled.first().and_then(|r| r.first().cloned()).flatten() == Some("1000.00".into()),
        "key 1000 as {spelled:?}, want the publisher's 1000.00"
    );
    let conflicts = c.value(1, "SELECT count(*) FROM mm.conflict_log").await?;
    ensure!(conflicts == 0, "{conflicts} conflicts logged on gmg2");
    let after = applied_txns(&c.stream_status("gmg1", "gmg2").await?);
    ensure!(
        after - before == stmts.len() as u64,
        "status counts {} applied transactions, want {}",
        after - before,
        stmts.len()
    );
    // Rows 11..99 were last written by the 300 update transactions.
    let writes = c.value(
        1,
        r#"SELECT count(DISTINCT (xmin::text, cmin::text)) FROM "mm_v" WHERE id BETWEEN 11 AND 99"#,
    )
    .await?;
    ensure!(
        writes * 5 < 89,
        "{writes} statements wrote 89 rows updated by 89 transactions: not merged"
    );
    Ok(())
}

/// Merged statements (`sql::fast_update_many`, `fast_delete_many`) type
/// their VALUES by the local column types: a fixed-length key must find
/// its own row, not the one its first character names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_statements_keep_fixed_length_keys_and_values() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start_opts(
        &["gfx1", "gfx2"],
        "CREATE TABLE fx (k char(4) PRIMARY KEY, c char(6) NOT NULL, b bit(4) NOT NULL);",
        ClusterOptions {
            agent_toml: GROUPS.to_owned(),
            ..ClusterOptions::default()
        },
    )
    .await?;
    c.pg[0]
        .execute("INSERT INTO fx SELECT k, 'x', B'1010' FROM unnest(ARRAY['a', 'ab', 'b', 'bc', 'c', 'cd']) k")
        .await?;
    c.wait_sync(60).await?;
    c.pause("gfx1", "gfx2").await?;
    let mut stmts = Vec::new();
    for k in ["ab", "bc", "cd"] {
        stmts.push(format!(
            "UPDATE fx SET c = 'hello', b = B'0110' WHERE k = '{k}'"
        ));
    }
    for k in ["ab", "bc", "cd"] {
        stmts.push(format!("DELETE FROM fx WHERE k = '{k}'"));
    }
    for k in ["a", "b", "c"] {
        stmts.push(format!("UPDATE fx SET c = 'world' WHERE k = '{k}'"));
    }
    c.run_each(0, &stmts).await?;
    c.resume("gfx1", "gfx2").await?;
    c.wait_sync(60).await?;
    let rows = c
        .assert_same("SELECT k, c, b::text FROM fx ORDER BY k")
        .await?;
    let got: Vec<String> = rows
        .iter()
        .map(|r| {
            r.iter()
                .map(|v| v.clone().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect();
    let want = ["a   |world |1010", "b   |world |1010", "c   |world |1010"];
    ensure!(got == want, "rows on gfx2: {got:?}, want {want:?}");
    Ok(())
}
