//! Batched commits (`apply/batch.rs`, on by default): a backlog of
//! single-change transactions is applied by CALLs of a procedure that
//! commits each transaction on its own. Each remote transaction stays one
//! local transaction with its origin's commit timestamp, is applied
//! exactly once and in order; a conflict inside a batch is resolved as
//! without batches; an error inside a batch names its transaction, those
//! before it stay applied and none after it is; hostile table and column
//! names (the procedure's own variable names, its dollar-quote tag) are
//! data.
//!
//! Batches show in the subscriber's catalog: the apply session's
//! temporary procedures `pg_temp_N.mm_batch_K`.

use anyhow::{Context, Result, ensure};
use mm_tests::TestCluster;

const SCHEMA: &str = "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL);";

/// 3000 single-row transactions (inserts, then updates and deletes of some
/// of those rows) wait behind a paused stream; two of the inserted keys
/// were written on the subscriber earlier. After resuming: identical nodes
/// with the publisher's newer rows, exactly two conflicts, every
/// transaction counted once, every row written by a local transaction of
/// its own carrying its origin's commit timestamp, and batch procedures
/// for each kind of change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_single_row_transactions_is_applied_in_batches_each_committed_alone()
-> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["bat1", "bat2"], SCHEMA).await?;
    let rows = c.a_backlog_with_two_conflicts("bat1", "bat2").await?;
    // One local transaction per remote one, with the origin's timestamp.
    let xids = c
        .value(1, "SELECT count(DISTINCT xmin::text) FROM items")
        .await?;
    ensure!(
        xids == rows.len() as i64,
        "{xids} local transactions wrote {} rows",
        rows.len()
    );
    c.assert_same(
        "SELECT id, pg_catalog.pg_xact_commit_timestamp(xmin)::text FROM items ORDER BY id",
    )
    .await
    .context("row versions differ")?;
    let procs = c.batch_procedures(1).await?;
    ensure!(
        procs >= 3,
        "{procs} batch procedures on bat2: inserts, updates and deletes were not batched"
    );
    Ok(())
}

/// A CHECK constraint only the subscriber has stops the stream at the row
/// that violates it, in the middle of a batch: the error names that
/// transaction, the 24 before it are applied (their procedure committed
/// each), none after it; once the constraint is dropped, everything is
/// applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_in_a_batch_names_its_transaction_and_keeps_those_before_it() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["berr1", "berr2"], SCHEMA).await?;
    c.an_error_in_a_backlog_names_its_transaction("berr1", "berr2")
        .await?;
    let xids = c
        .value(1, "SELECT count(DISTINCT xmin::text) FROM items")
        .await?;
    ensure!(xids == 50, "{xids} local transactions applied 50");
    ensure!(
        c.batch_procedures(1).await? >= 1,
        "no batch procedure on berr2: the backlog was not batched"
    );
    Ok(())
}

/// A table and columns named like the batch procedure's variables, its
/// table alias, its CTE and its dollar-quote tag: a user's name must not
/// capture one of ours, nor break the procedure's text.
const HOSTILE: &str = r#"CREATE TABLE "mm_t" ("mm_i" int PRIMARY KEY, "mm_key" text, "mm_c1" int NOT NULL, "mm_ts" text, "$mm_batch0$" text, "d" int);"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_keep_hostile_names_as_data() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["bhn1", "bhn2"], HOSTILE).await?;
    c.pause("bhn1", "bhn2").await?;
    let mut stmts: Vec<String> = (1..=300)
        .map(|id| {
            format!(
                r#"INSERT INTO "mm_t" VALUES ({id}, 'k{id}', {id}, 'ts{id}', '$mm_batch0$ {id}', {id})"#
            )
        })
        .collect();
    stmts.extend((1..=120).map(|id| {
        format!(
            r#"UPDATE "mm_t" SET "mm_c1" = "mm_c1" + 1000, "$mm_batch0$" = NULL WHERE "mm_i" = {id}"#
        )
    }));
    stmts.extend((201..=260).map(|id| format!(r#"DELETE FROM "mm_t" WHERE "mm_i" = {id}"#)));
    c.run_each(0, &stmts).await?;
    c.resume("bhn1", "bhn2").await?;
    c.wait_sync(120).await?;
    let rows = c
        .assert_same(r#"SELECT * FROM "mm_t" ORDER BY "mm_i""#)
        .await?;
    ensure!(rows.len() == 240, "{} rows", rows.len());
    let updated = c
        .value(
            1,
            r#"SELECT count(*) FROM "mm_t" WHERE "mm_c1" > 1000 AND "$mm_batch0$" IS NULL"#,
        )
        .await?;
    ensure!(updated == 120, "{updated} rows updated on bhn2, want 120");
    ensure!(
        c.batch_procedures(1).await? >= 3,
        "the hostile table's changes were not batched"
    );
    Ok(())
}

const TWO_TABLES: &str = "CREATE TABLE acc (id int PRIMARY KEY, n int NOT NULL);
CREATE TABLE hist (id int PRIMARY KEY, aid int NOT NULL);";

/// Transactions of two row changes each (an UPDATE of one table, an
/// INSERT into another, as TPC-B's) are batched too: 300 of them behind a
/// paused stream, one of whose inserts meets a row the subscriber wrote
/// earlier. Both changes of each transaction commit together, in one local
/// transaction with the origin's commit timestamp; the conflict is
/// resolved once; nodes identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_of_several_changes_are_batched_each_committed_whole() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["bmc1", "bmc2"], TWO_TABLES).await?;
    c.pg[0]
        .execute("INSERT INTO acc SELECT g, 0 FROM generate_series(1, 300) g")
        .await?;
    c.wait_sync(60).await?;
    c.pause("bmc1", "bmc2").await?;
    c.pause("bmc2", "bmc1").await?;
    // Older than the publisher's insert of the same key: it loses.
    c.run_each(1, &["INSERT INTO hist VALUES (150, -1)".to_owned()])
        .await?;
    let stmts: Vec<String> = (1..=300)
        .map(|id| {
            format!(
                "WITH u AS (UPDATE acc SET n = n + 1 WHERE id = {id} RETURNING id) \
                 INSERT INTO hist SELECT id, id FROM u"
            )
        })
        .collect();
    c.run_each(0, &stmts).await?;
    c.resume("bmc1", "bmc2").await?;
    c.resume("bmc2", "bmc1").await?;
    c.wait_sync(120).await?;

    c.assert_same("SELECT id, n FROM acc ORDER BY id").await?;
    let hist = c
        .assert_same("SELECT id, aid FROM hist ORDER BY id")
        .await?;
    ensure!(hist.len() == 300, "{} history rows", hist.len());
    ensure!(
        c.value(1, "SELECT aid FROM hist WHERE id = 150").await? == 150,
        "the publisher's newer history row 150 did not win on bmc2"
    );
    let conflicts = c.value(1, "SELECT count(*) FROM mm.conflict_log").await?;
    ensure!(
        conflicts == 1,
        "{conflicts} conflicts logged on bmc2, want 1"
    );
    let apart = c
        .value(
            1,
            "SELECT count(*) FROM acc a JOIN hist h ON h.id = a.id WHERE a.xmin::text <> h.xmin::text",
        )
        .await?;
    ensure!(
        apart == 0,
        "{apart} transactions' two changes committed apart on bmc2"
    );
    let xids = c
        .value(1, "SELECT count(DISTINCT xmin::text) FROM hist")
        .await?;
    ensure!(xids == 300, "{xids} local transactions applied 300");
    c.assert_same(
        "SELECT id, pg_catalog.pg_xact_commit_timestamp(xmin)::text FROM hist ORDER BY id",
    )
    .await
    .context("row versions differ")?;
    ensure!(
        c.batch_procedures(1).await? >= 1,
        "the two-change transactions were not batched"
    );
    Ok(())
}

/// An insert in the middle of a batch meets a tombstone newer than it: the
/// subscriber inserted the same key after the publisher and deleted it
/// again. Only the re-check after the insert sees the tombstone (the row is
/// gone, so the insert itself goes in); the delete wins, the key stays
/// deleted on both nodes, and the transactions around it stay batched and
/// applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_in_a_batch_loses_to_a_newer_delete_of_its_key() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["btb1", "btb2"], SCHEMA).await?;
    c.pause("btb1", "btb2").await?;
    c.pause("btb2", "btb1").await?;
    let mut stmts: Vec<String> = (1001..=1300)
        .map(|id| format!("INSERT INTO items VALUES ({id}, {id})"))
        .collect();
    stmts.insert(150, "INSERT INTO items VALUES (5, 5)".to_owned());
    c.run_each(0, &stmts).await?;
    // Newer than the publisher's insert of key 5: the subscriber's delete.
    c.run_each(
        1,
        &[
            "INSERT INTO items VALUES (5, -5)".to_owned(),
            "DELETE FROM items WHERE id = 5".to_owned(),
        ],
    )
    .await?;
    c.resume("btb1", "btb2").await?;
    c.resume("btb2", "btb1").await?;
    c.wait_sync(120).await?;

    let rows = c.assert_same("SELECT id, v FROM items ORDER BY id").await?;
    ensure!(rows.len() == 300, "{} rows, want 300", rows.len());
    ensure!(
        c.value(1, "SELECT count(*) FROM items WHERE id = 5")
            .await?
            == 0,
        "the publisher's older insert of key 5 outlived btb2's newer delete"
    );
    let logged = c
        .value(
            1,
            "SELECT count(*) FROM mm.conflict_log WHERE key->>'id' = '5'",
        )
        .await?;
    ensure!(
        logged == 1,
        "{logged} conflicts on key 5 logged on btb2, want 1"
    );
    ensure!(
        c.batch_procedures(1).await? >= 1,
        "the inserts were not batched"
    );
    Ok(())
}

/// Transactions that insert a key and delete it again: the delete writes
/// the key's tombstone in the same transaction, which the insert's
/// re-check must not take for someone else's. No conflict, no rollback,
/// nothing left, still batched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_deleting_the_key_it_inserted_is_no_conflict() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["bid1", "bid2"], SCHEMA).await?;
    c.pause("bid1", "bid2").await?;
    let stmts: Vec<String> = (1..=200)
        .map(|id| {
            format!(
                "BEGIN; INSERT INTO items VALUES ({id}, {id}); \
                 DELETE FROM items WHERE id = {id}; COMMIT"
            )
        })
        .collect();
    c.run_each(0, &stmts).await?;
    c.resume("bid1", "bid2").await?;
    c.wait_sync(120).await?;
    let rows = c.assert_same("SELECT id, v FROM items ORDER BY id").await?;
    ensure!(rows.is_empty(), "{} rows left", rows.len());
    let conflicts = c.value(1, "SELECT count(*) FROM mm.conflict_log").await?;
    ensure!(conflicts == 0, "{conflicts} conflicts logged on bid2");
    let s = c.stream_status("bid1", "bid2").await?;
    ensure!(
        s["conflict_rollbacks"].as_u64() == Some(0),
        "a transaction's own tombstone rolled its batch back on bid2: {s}"
    );
    ensure!(
        c.batch_procedures(1).await? >= 1,
        "the insert-and-delete transactions were not batched"
    );
    Ok(())
}

/// A table too wide for a procedure's arguments (PostgreSQL takes at most
/// 100; a batch passes one array per value) stays out of batches: its
/// transactions go one statement each and are applied, and the narrow
/// table's backlog after them is still batched. Before, the wide table's
/// procedure failed to be created and batches were off for the session;
/// now it is not tried (a refused procedure would turn off its shape only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_too_wide_for_a_procedure_leaves_batches_to_the_others() -> Result<()> {
    mm_tests::init_tracing();
    let cols: Vec<String> = (1..=120).map(|n| format!("c{n} int")).collect();
    let schema = format!(
        "{SCHEMA} CREATE TABLE wide (id int PRIMARY KEY, {});",
        cols.join(", ")
    );
    let c = TestCluster::start(&["bwd1", "bwd2"], &schema).await?;
    c.pause("bwd1", "bwd2").await?;
    let values: Vec<String> = (1..=120).map(|n| n.to_string()).collect();
    let mut stmts: Vec<String> = (1..=200)
        .map(|id| format!("INSERT INTO wide VALUES ({id}, {})", values.join(", ")))
        .collect();
    stmts.extend((1..=300).map(|id| format!("INSERT INTO items VALUES ({id}, {id})")));
    stmts.extend((1..=100).map(|id| format!("UPDATE wide SET c7 = -{id} WHERE id = {id}")));
    c.run_each(0, &stmts).await?;
    c.resume("bwd1", "bwd2").await?;
    c.wait_sync(120).await?;
    let wide = c.assert_same("SELECT * FROM wide ORDER BY id").await?;
    ensure!(wide.len() == 200, "{} wide rows, want 200", wide.len());
    let items = c.assert_same("SELECT id, v FROM items ORDER BY id").await?;
    ensure!(items.len() == 300, "{} items, want 300", items.len());
    let updated = c.value(1, "SELECT count(*) FROM wide WHERE c7 < 0").await?;
    ensure!(
        updated == 100,
        "{updated} wide rows updated on bwd2, want 100"
    );
    ensure!(
        c.batch_procedures(1).await? >= 1,
        "the narrow table's inserts were not batched after the wide table's"
    );
    // The wide shape was never tried: no procedure refused.
    let log = c.agents[1].log();
    ensure!(
        !log.contains("cannot create"),
        "bwd2 tried a batch procedure the server refused:\n{log}"
    );
    Ok(())
}
