//! Plans of the merged statements a group applies (`merge.rs`): each
//! joins a VALUES list of keys to the table and runs as a generic plan. A
//! backlog of deletes leaves a table with its pages and few rows; once
//! ANALYZE has seen that, a hash join over a sequential scan of the whole
//! table per statement is cheapest in the planner's eyes. The apply
//! sessions' planner settings (`sql::PLANNER_SETTINGS`) must keep them on
//! the key's index whatever the statistics say.

use anyhow::{Result, ensure};
use mm_agent::apply::sql;
use mm_tests::versions::node_with_schema;

const ROWS: usize = 100;

/// The generic plan of `stmt`, with `row` giving each row's parameters
/// and the shared ones (`sql::MANY_EXTRA_PARAMS`) empty.
async fn generic_plan(
    c: &tokio_postgres::Client,
    name: &str,
    stmt: &str,
    row: impl Fn(usize) -> String,
) -> Result<String> {
    c.batch_execute(&format!("PREPARE {name} AS {stmt}"))
        .await?;
    let mut args: Vec<String> = (0..ROWS).map(row).collect();
    args.extend(std::iter::repeat_n(
        "'{}'".to_owned(),
        sql::MANY_EXTRA_PARAMS,
    ));
    let rows = c
        .query(&format!("EXPLAIN EXECUTE {name}({})", args.join(", ")), &[])
        .await?;
    let plan: Vec<String> = rows.iter().map(|r| r.get::<_, String>(0)).collect();
    Ok(plan.join("\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_statements_stay_on_the_key_index_when_a_table_empties() -> Result<()> {
    mm_tests::init_tracing();
    let (_pg, c) = node_with_schema("mp").await?;
    c.batch_execute(
        "CREATE TABLE t (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
         INSERT INTO t SELECT g, 0, md5(g::text) FROM generate_series(1, 50000) g;
         DELETE FROM t WHERE id <= 46000;
         ANALYZE t;
         SET plan_cache_mode = force_generic_plan;",
    )
    .await?;
    let relid: u32 = c.query_one("SELECT 't'::regclass::oid", &[]).await?.get(0);
    let table = sql::qualified("public", "t");
    let delete = sql::fast_delete_many(&table, &["id"], &["bigint"], relid, ROWS);
    let update = sql::fast_update_many(&table, &["n"], &["bigint"], &["id"], &["bigint"], ROWS);
    let del_row = |i: usize| format!("{}, now()", 46001 + i);
    let upd_row = |i: usize| format!("1, {}, now()", 46001 + i);

    // Without the settings the planner does take the scan: what this
    // guards against is real.
    let plan = generic_plan(&c, "d0", &delete, del_row).await?;
    ensure!(
        plan.contains("Seq Scan on t"),
        "the scenario no longer tempts the planner:\n{plan}"
    );

    for s in sql::PLANNER_SETTINGS {
        c.batch_execute(s).await?;
    }
    for (name, stmt, plan) in [
        (
            "d1",
            "delete",
            generic_plan(&c, "d1", &delete, del_row).await?,
        ),
        (
            "u1",
            "update",
            generic_plan(&c, "u1", &update, upd_row).await?,
        ),
    ] {
        ensure!(
            !plan.contains("Seq Scan on t") && plan.contains("Index Scan using t_pkey on t"),
            "merged {stmt} ({name}) does not look rows up by key:\n{plan}"
        );
    }
    Ok(())
}
