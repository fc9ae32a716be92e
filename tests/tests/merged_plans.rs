//! Plans of the merged statements a group applies (`merge.rs`): each
//! joins a VALUES list of keys to the table and runs as a generic plan. A
//! backlog of deletes leaves a table with its pages and few rows; once
//! ANALYZE has seen that, a hash join over a sequential scan of the whole
//! table per statement is cheapest in the planner's eyes. The key bound
//! (`sql::key_join`) keeps every scan of the table on the statement's own
//! keys whatever the statistics say, and the apply sessions' planner
//! settings (`sql::PLANNER_SETTINGS`) leave the join of those rows to the
//! VALUES list linear.

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
    row: &dyn Fn(usize) -> String,
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

/// The merged delete and update (`n` set by key) of 100 rows of `table`
/// (`id bigint PRIMARY KEY, n bigint`), as a group applies them.
async fn merged_statements(c: &tokio_postgres::Client, table: &str) -> Result<(String, String)> {
    let relid: u32 = c
        .query_one(&format!("SELECT '{table}'::regclass::oid"), &[])
        .await?
        .get(0);
    let t = sql::qualified("public", table);
    Ok((
        sql::fast_delete_many(
            &t,
            &["id"],
            &["bigint"],
            relid,
            ROWS,
            sql::TombstoneWrite::Insert,
        ),
        sql::fast_update_many(&t, &["n"], &["bigint"], &["id"], &["bigint"], ROWS),
    ))
}

/// The key bound `sql::key_join` adds for key column `id` and VALUES
/// column `mm_{v}`: stripped to show what a plan would be without it.
fn bound(v: usize) -> String {
    format!(" AND mm_t.\"id\" = ANY (ARRAY(SELECT mm_b.mm_{v} FROM mm_v AS mm_b))")
}

/// The generic plans of a merged delete and update (prepared as
/// `{prefix}d`, `{prefix}u`), each with what it is.
async fn merged_plans(
    c: &tokio_postgres::Client,
    prefix: &str,
    (delete, del_row): (&str, &dyn Fn(usize) -> String),
    (update, upd_row): (&str, &dyn Fn(usize) -> String),
) -> Result<[(String, String); 2]> {
    Ok([
        (
            format!("delete ({prefix}d)"),
            generic_plan(c, &format!("{prefix}d"), delete, del_row).await?,
        ),
        (
            format!("update ({prefix}u)"),
            generic_plan(c, &format!("{prefix}u"), update, upd_row).await?,
        ),
    ])
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
    let (delete, update) = merged_statements(&c, "t").await?;
    let del_row = |i: usize| format!("{}, now()", 46001 + i);
    let upd_row = |i: usize| format!("1, {}, now()", 46001 + i);

    // Without the settings (and the key bound, which also keeps the hashed
    // side to the statement's keys) the planner does take the scan: what
    // this guards against is real.
    ensure!(delete.contains(&bound(1)));
    let plan = generic_plan(&c, "d0", &delete.replace(&bound(1), ""), &del_row).await?;
    ensure!(
        plan.contains("Seq Scan on t"),
        "the scenario no longer tempts the planner:\n{plan}"
    );

    for s in sql::PLANNER_SETTINGS {
        c.batch_execute(s).await?;
    }
    for (what, plan) in merged_plans(&c, "a", (&delete, &del_row), (&update, &upd_row)).await? {
        ensure!(
            !plan.contains("Seq Scan on t") && plan.contains("Index Scan using t_pkey on t"),
            "merged {what} does not look rows up by key:\n{plan}"
        );
        ensure!(!compares_every_pair(&plan), "merged {what}:\n{plan}");
    }
    Ok(())
}

/// Whether a plan joins the statement's rows to the table by a nested loop
/// over a materialized side: every VALUES row against every row the key
/// scan found, 100 x 100 comparisons per statement (half of a merged
/// DELETE's time), where a hash join (or a loop probing the index per
/// key) does one lookup per row.
fn compares_every_pair(plan: &str) -> bool {
    plan.contains("Materialize")
}

/// Every key-index scan of a plan has an index condition: none reads the
/// whole index.
fn unbounded_index_scans(plan: &str) -> usize {
    let lines: Vec<&str> = plan.lines().collect();
    lines
        .iter()
        .enumerate()
        .filter(|(i, l)| {
            l.contains("Index Scan using t2_pkey on t2")
                && !lines
                    .get(i + 1)
                    .is_some_and(|next| next.contains("Index Cond"))
        })
        .count()
}

/// ANALYZE running while a large transaction inserts into a table (an
/// autovacuum during a careful-path load, say) records its pages with no
/// live rows; the planner then takes the table for one row and, left to
/// itself, joins a merged statement's VALUES list by scanning the whole key
/// index as the outer side (a bench run of grouped DELETEs: 40 ms per
/// 100-row statement, 40x slower). The merged statements bound each key
/// column by their own keys, so any join order reads only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_statements_read_only_their_keys_when_analyze_saw_the_table_empty() -> Result<()> {
    mm_tests::init_tracing();
    let (pg, c) = node_with_schema("mq").await?;
    c.batch_execute(
        "CREATE TABLE t2 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL)
             WITH (autovacuum_enabled = off)",
    )
    .await?;
    c.batch_execute(
        "BEGIN;
         INSERT INTO t2 SELECT g, 0, md5(g::text) FROM generate_series(1, 50000) g;",
    )
    .await?;
    let other = pg.connect().await?;
    other.batch_execute("ANALYZE t2").await?;
    c.batch_execute("COMMIT; SET plan_cache_mode = force_generic_plan;")
        .await?;
    let stats = c
        .query_one(
            "SELECT relpages::bigint, reltuples::float8 FROM pg_class WHERE oid = 't2'::regclass",
            &[],
        )
        .await?;
    let (pages, tuples): (i64, f64) = (stats.get(0), stats.get(1));
    ensure!(
        pages > 0 && tuples == 0.0,
        "ANALYZE did not see the table as pages without rows: {pages} pages, {tuples} rows"
    );
    for s in sql::PLANNER_SETTINGS {
        c.batch_execute(s).await?;
    }
    let (delete, update) = merged_statements(&c, "t2").await?;
    let del_row = |i: usize| format!("{}, now()", 1 + i);
    let upd_row = |i: usize| format!("1, {}, now()", 1 + i);

    // The scenario is real: without the bound the whole index is read.
    ensure!(delete.contains(&bound(1)) && update.contains(&bound(2)));
    let plan = generic_plan(&c, "q0", &delete.replace(&bound(1), ""), &del_row).await?;
    ensure!(
        unbounded_index_scans(&plan) == 1,
        "without the bound the planner no longer reads the whole index:\n{plan}"
    );

    for (what, plan) in merged_plans(&c, "q", (&delete, &del_row), (&update, &upd_row)).await? {
        ensure!(
            !plan.contains("Seq Scan on t2") && unbounded_index_scans(&plan) == 0,
            "merged {what} reads more than its keys:\n{plan}"
        );
        ensure!(!compares_every_pair(&plan), "merged {what}:\n{plan}");
    }
    // And they still change exactly their rows.
    let n = c
        .query_one(
            &format!(
                "EXECUTE qd({}, '{{0}}', '{{}}', '{{}}')",
                (0..ROWS).map(del_row).collect::<Vec<_>>().join(", ")
            ),
            &[],
        )
        .await;
    ensure!(
        n.is_ok(),
        "the bounded delete failed: {:?}",
        n.map_err(|e| e.as_db_error().map(|d| d.message().to_owned()))
    );
    let left: i64 = c.query_one("SELECT count(*) FROM t2", &[]).await?.get(0);
    ensure!(left == 50000 - ROWS as i64, "{left} rows left");
    Ok(())
}
