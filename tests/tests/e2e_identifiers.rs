//! Hostile identifiers (issue: user columns named like the agent's own SQL
//! aliases). Every statement the agent generates must treat a user's table
//! and column names as data: no alias, CTE name, function name or plpgsql
//! variable of ours may be captured by one of theirs.
//!
//! A property test over real PostgreSQL: tables and columns are named from a
//! pool holding every alias, CTE and function name the generated SQL uses,
//! SQL keywords, quotes, dots, spaces, comment and parameter markers and
//! unicode, drawn at random (seeded: `MM_SEED=<n>` replays; the seed is
//! printed). Through each table the test drives the three conflict shapes of
//! the careful path (insert_exists, update_origin_differs, update vs delete)
//! plus a local delete (tombstone trigger), and checks that both nodes end
//! identical with last-writer-wins' outcome and that `mm.conflict_log` holds
//! the real rows (not one column's value) as local and remote tuples.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use mm_tests::TestCluster;
use mm_tests::rng::{Rng, seed};
use serde_json::{Map, Value, json};

/// Every alias, CTE name and function the agent's generated SQL mentions,
/// plus names that break naive quoting.
const POOL: &[&str] = &[
    "x",
    "r",
    "o",
    "v",
    "u",
    "d",
    "i",
    "e",
    "tb",
    "c",
    "n",
    "lg",
    "l",
    "mm_l",
    "mm_o",
    "mm_c",
    "mm_d",
    "mm_p",
    "mm_row",
    "mm_ts",
    "mm_origin",
    "mm_routine",
    "mm_decision",
    "conflict_log",
    "cols",
    "key",
    "value",
    "relid",
    "roident",
    "timestamp",
    "tg_relid",
    "mm",
    "mm_old",
    "to_jsonb",
    "count",
    "conflict",
    "routine",
    "one_row",
    "jsonb_build_object",
    "pg_catalog",
    "select",
    "from",
    "where",
    "order",
    "user",
    "table",
    "default",
    "a\"b",
    "it's",
    "a.b",
    "my col",
    " lead",
    "UPPER",
    "$1",
    "--c",
    "/*c*/",
    "ñandú",
    "列",
    "🙂",
];

fn qi(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn ql(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ty {
    Int,
    Text,
}

#[derive(Debug, Clone)]
struct Table {
    name: String,
    key: String,
    cols: Vec<(String, Ty)>,
}

/// One row's values for the non-key columns (`None`: NULL).
type Vals = Vec<Option<String>>;

impl Table {
    fn sql(&self) -> String {
        qi(&self.name)
    }

    fn ddl(&self) -> String {
        let mut s = format!(
            "CREATE TABLE {} ({} int PRIMARY KEY",
            self.sql(),
            qi(&self.key)
        );
        for (c, t) in &self.cols {
            let ty = match t {
                Ty::Int => "bigint",
                Ty::Text => "text",
            };
            s.push_str(&format!(", {} {ty}", qi(c)));
        }
        s.push_str(");");
        s
    }

    fn lit(&self, i: usize, v: &Option<String>) -> String {
        match (v, self.cols[i].1) {
            (None, _) => "NULL".into(),
            (Some(v), Ty::Int) => v.clone(),
            (Some(v), Ty::Text) => ql(v),
        }
    }

    fn insert(&self, id: i32, vals: &Vals) -> String {
        let mut names = vec![qi(&self.key)];
        let mut lits = vec![id.to_string()];
        for (i, v) in vals.iter().enumerate() {
            names.push(qi(&self.cols[i].0));
            lits.push(self.lit(i, v));
        }
        format!(
            "INSERT INTO {} ({}) VALUES ({})",
            self.sql(),
            names.join(", "),
            lits.join(", ")
        )
    }

    fn update(&self, id: i32, vals: &Vals) -> String {
        let sets: Vec<String> = vals
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{} = {}", qi(&self.cols[i].0), self.lit(i, v)))
            .collect();
        format!(
            "UPDATE {} SET {} WHERE {} = {id}",
            self.sql(),
            sets.join(", "),
            qi(&self.key)
        )
    }

    fn delete(&self, id: i32) -> String {
        format!("DELETE FROM {} WHERE {} = {id}", self.sql(), qi(&self.key))
    }

    /// The row as `to_jsonb` renders it.
    fn json(&self, id: i32, vals: &Vals) -> Value {
        let mut m = Map::new();
        m.insert(self.key.clone(), json!(id));
        for (i, v) in vals.iter().enumerate() {
            let j = match (v, self.cols[i].1) {
                (None, _) => Value::Null,
                (Some(v), Ty::Int) => json!(v.parse::<i64>().unwrap_or_default()),
                (Some(v), Ty::Text) => json!(v),
            };
            m.insert(self.cols[i].0.clone(), j);
        }
        Value::Object(m)
    }

    /// Every column as text, ordered by key: identical on every node.
    fn dump(&self) -> String {
        let mut cols = vec![format!("{}::text", qi(&self.key))];
        for (c, _) in &self.cols {
            cols.push(format!("{}::text", qi(c)));
        }
        format!("SELECT {} FROM {} ORDER BY 1", cols.join(", "), self.sql())
    }
}

fn random_vals(rng: &mut Rng, t: &Table, tag: &str) -> Vals {
    t.cols
        .iter()
        .map(|(_, ty)| {
            // A NULL in a column named like an alias broke the careful path.
            if rng.pick(3) == 0 {
                return None;
            }
            Some(match ty {
                Ty::Int => (rng.pick(1_000_000) as i64 - 500_000).to_string(),
                Ty::Text => format!("{tag} it's \"{}\"", rng.pick(1000)),
            })
        })
        .collect()
}

/// Tables for one run: the two names the bug was found with first, the
/// in-place statement's own names for the locked version (`mm_l`, `l`,
/// `mm_o`) next, then random ones.
fn tables(rng: &mut Rng, n: usize) -> Vec<Table> {
    let mut out = vec![
        Table {
            name: "x".into(),
            key: "id".into(),
            cols: vec![("x".into(), Ty::Text), ("r".into(), Ty::Int)],
        },
        Table {
            name: "mm_l".into(),
            key: "mm_o".into(),
            cols: vec![("l".into(), Ty::Text), ("mm_row".into(), Ty::Int)],
        },
    ];
    let mut used_tables: BTreeSet<String> = BTreeSet::from(["x".to_owned(), "mm_l".to_owned()]);
    while out.len() < n {
        let name = POOL[rng.pick(POOL.len())].to_owned();
        if !used_tables.insert(name.clone()) {
            continue;
        }
        let mut names: BTreeSet<String> = BTreeSet::new();
        let want = 2 + rng.pick(3);
        while names.len() < want + 1 {
            names.insert(POOL[rng.pick(POOL.len())].to_owned());
        }
        let mut names: Vec<String> = names.into_iter().collect();
        let key = names.remove(rng.pick(names.len()));
        let cols = names
            .into_iter()
            .map(|c| {
                let ty = if rng.pick(2) == 0 { Ty::Int } else { Ty::Text };
                (c, ty)
            })
            .collect();
        out.push(Table { name, key, cols });
    }
    out
}

/// `(local_tuple, remote_tuple)` of node `i`'s conflict of `ty` on `table` key `id`.
async fn logged_tuples(
    c: &TestCluster,
    i: usize,
    t: &Table,
    ty: &str,
    id: i32,
) -> Result<(Option<Value>, Option<Value>)> {
    let rel = format!("public.{}", t.name);
    let rows = c
        .rows(
            i,
            &format!(
                "SELECT local_tuple::text, remote_tuple::text FROM mm.conflict_log \
                 WHERE relation = {} AND conflict_type = {} AND key = jsonb_build_object({}, {id})",
                ql(&rel),
                ql(ty),
                ql(&t.key)
            ),
        )
        .await?;
    ensure!(
        rows.len() == 1,
        "{}: {} {ty} rows for {rel} key {id} (want 1): {rows:?}",
        c.pg[i].name(),
        rows.len()
    );
    let parse = |v: &Option<String>| -> Result<Option<Value>> {
        v.as_deref()
            .map(serde_json::from_str)
            .transpose()
            .context("conflict_log tuple is not json")
    };
    Ok((parse(&rows[0][0])?, parse(&rows[0][1])?))
}

fn expect_tuple(what: &str, got: &Option<Value>, want: &Value) -> Result<()> {
    ensure!(
        got.as_ref() == Some(want),
        "{what}:\n got {got:?}\nwant {want}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_identifiers_through_every_conflict_path() -> Result<()> {
    mm_tests::init_tracing();
    let seed = seed()?;
    eprintln!("e2e_identifiers seed: MM_SEED={seed}");
    let mut rng = Rng::new(seed);
    let ts = tables(&mut rng, 7);
    let schema: String = ts.iter().map(Table::ddl).collect::<Vec<_>>().join("\n");
    eprintln!("schema:\n{schema}");
    let c = TestCluster::start(&["hid1", "hid2"], &schema)
        .await
        .with_context(|| format!("seed {seed}"))?;
    let r = run(&c, &ts, &mut rng).await;
    r.with_context(|| format!("seed {seed}; schema:\n{schema}"))?;
    // Conflicts leave no stray warnings in the server logs (a ROLLBACK sent
    // with no transaction open did, once per conflict), and agent logs
    // written to a file carry no terminal colour codes.
    for (pg, agent) in c.pg.iter().zip(&c.agents) {
        let log = std::fs::read_to_string(pg.log_path()).unwrap_or_default();
        let n = log.matches("there is no transaction in progress").count();
        ensure!(
            n == 0,
            "{}: {n} 'no transaction in progress' warnings",
            pg.name()
        );
        ensure!(
            !agent.log().contains('\u{1b}'),
            "agent {} logs ANSI escape codes to a file",
            agent.name
        );
    }
    Ok(())
}

async fn run(c: &TestCluster, ts: &[Table], rng: &mut Rng) -> Result<()> {
    // Keys 2 and 3 exist everywhere before the concurrent writes; key 4 is
    // deleted locally on B (the tombstone trigger), key 5 stays put.
    let mut seeded = Vec::new();
    for t in ts {
        let mut s = Vec::new();
        for id in 2..=5 {
            let v = random_vals(rng, t, "seed");
            c.pg[0].execute(&t.insert(id, &v)).await?;
            s.push(v);
        }
        seeded.push(s);
    }
    c.wait_sync(60).await?;
    // Let the watermarks pass the seed rows, so the next writes meet them
    // as routine, and only the concurrent ones below are conflicts.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for t in ts {
        c.pg[1].execute(&t.delete(4)).await?;
    }
    c.wait_sync(60).await?;

    c.pause("hid1", "hid2").await?;
    c.pause("hid2", "hid1").await?;
    let mut a_vals = Vec::new();
    let mut b_vals = Vec::new();
    for t in ts {
        let a1 = random_vals(rng, t, "a1");
        let a2 = random_vals(rng, t, "a2");
        c.pg[0].execute(&t.insert(1, &a1)).await?;
        c.pg[0].execute(&t.update(2, &a2)).await?;
        c.pg[0].execute(&t.delete(3)).await?;
        a_vals.push((a1, a2));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    for t in ts {
        let b1 = random_vals(rng, t, "b1");
        let b2 = random_vals(rng, t, "b2");
        let b3 = random_vals(rng, t, "b3");
        c.pg[1].execute(&t.insert(1, &b1)).await?;
        c.pg[1].execute(&t.update(2, &b2)).await?;
        c.pg[1].execute(&t.update(3, &b3)).await?;
        b_vals.push((b1, b2, b3));
    }
    c.resume("hid1", "hid2").await?;
    c.resume("hid2", "hid1").await?;
    c.wait_sync(90).await?;

    for (k, t) in ts.iter().enumerate() {
        let rows = c.assert_same(&t.dump()).await?;
        // B wrote last everywhere: its rows win; key 4 stays deleted.
        let (b1, b2, b3) = &b_vals[k];
        let want: Vec<Vec<Option<String>>> = [(1, b1), (2, b2), (3, b3), (5, &seeded[k][3])]
            .iter()
            .map(|(id, v)| {
                let mut r = vec![Some(id.to_string())];
                r.extend(v.iter().cloned());
                r
            })
            .collect();
        if rows != want {
            bail!(
                "table {:?}: rows differ from last-writer-wins' outcome\n got {rows:?}\nwant {want:?}",
                t.name
            );
        }
        let (a1, a2) = &a_vals[k];
        // On A: B's insert over A's row, B's update over A's update, B's
        // update of the row A deleted (a resurrection with B's full row).
        let (l, r) = logged_tuples(c, 0, t, "insert_exists", 1).await?;
        expect_tuple("insert_exists local on A", &l, &t.json(1, a1))?;
        expect_tuple("insert_exists remote on A", &r, &t.json(1, b1))?;
        let (l, r) = logged_tuples(c, 0, t, "update_origin_differs", 2).await?;
        expect_tuple("update_origin_differs local on A", &l, &t.json(2, a2))?;
        expect_tuple("update_origin_differs remote on A", &r, &t.json(2, b2))?;
        let (l, r) = logged_tuples(c, 0, t, "update_deleted", 3).await?;
        ensure!(l.is_none(), "update_deleted on A has a local tuple: {l:?}");
        expect_tuple("update_deleted remote on A", &r, &t.json(3, b3))?;
        // On B: A's older changes lose, with the real rows logged.
        let (l, r) = logged_tuples(c, 1, t, "insert_exists", 1).await?;
        expect_tuple("insert_exists local on B", &l, &t.json(1, b1))?;
        expect_tuple("insert_exists remote on B", &r, &t.json(1, a1))?;
        let (l, r) = logged_tuples(c, 1, t, "update_origin_differs", 2).await?;
        expect_tuple("update_origin_differs local on B", &l, &t.json(2, b2))?;
        expect_tuple("update_origin_differs remote on B", &r, &t.json(2, a2))?;
        let (l, _) = logged_tuples(c, 1, t, "delete_origin_differs", 3).await?;
        expect_tuple("delete_origin_differs local on B", &l, &t.json(3, b3))?;
        // B's local delete of key 4 left a tombstone keyed by the real key.
        let tomb = c
            .rows(
                1,
                &format!(
                    "SELECT count(*)::text FROM mm.tombstones WHERE relid = {}::regclass \
                     AND key = jsonb_build_object({}, 4)",
                    ql(&format!("public.{}", qi(&t.name))),
                    ql(&t.key)
                ),
            )
            .await?;
        // Purged once every peer has seen the delete; it may already be gone,
        // but never under another key.
        let other = c
            .rows(
                1,
                &format!(
                    "SELECT count(*)::text FROM mm.tombstones WHERE relid = {}::regclass \
                     AND NOT key ? {}",
                    ql(&format!("public.{}", qi(&t.name))),
                    ql(&t.key)
                ),
            )
            .await?;
        ensure!(
            other[0][0].as_deref() == Some("0"),
            "table {:?}: tombstones not keyed by {:?}: {other:?} (matching: {tomb:?})",
            t.name,
            t.key
        );
    }
    hot_key_in_place(c, ts, rng).await
}

/// Updates of key 5 alternate between the nodes while both streams are
/// paused: A u1, B u2, A u3, B u4. The first conflict in each direction
/// makes the key hot; the second is settled inside the fast-path statement
/// (`sql::fast_update_in_place`, which names its own CTEs and columns next
/// to the user's): on B u3 loses to u4, on A u4 beats u3. The logged rows
/// are the real rows, and u4 is everywhere.
async fn hot_key_in_place(c: &TestCluster, ts: &[Table], rng: &mut Rng) -> Result<()> {
    let before = |s: &Value| s["conflicts_in_place"].as_u64().unwrap_or(0);
    let (a_before, b_before) = (
        before(&c.stream_status("hid2", "hid1").await?),
        before(&c.stream_status("hid1", "hid2").await?),
    );
    c.pause("hid1", "hid2").await?;
    c.pause("hid2", "hid1").await?;
    let mut vals = Vec::new();
    for t in ts {
        let u: Vec<Vals> = (1..=4)
            .map(|k| random_vals(rng, t, &format!("u{k}")))
            .collect();
        vals.push(u);
    }
    for k in 0..4 {
        for (t, u) in ts.iter().zip(&vals) {
            c.pg[k % 2].execute(&t.update(5, &u[k])).await?;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.resume("hid1", "hid2").await?;
    c.resume("hid2", "hid1").await?;
    c.wait_sync(90).await?;
    for (t, u) in ts.iter().zip(&vals) {
        let rows = c.assert_same(&t.dump()).await?;
        let five: Vec<&Vec<Option<String>>> = rows
            .iter()
            .filter(|r| r[0].as_deref() == Some("5"))
            .collect();
        let mut want = vec![Some("5".to_owned())];
        want.extend(u[3].iter().cloned());
        ensure!(
            five == [&want],
            "table {:?}: key 5 is {five:?}, want u4 {want:?}",
            t.name
        );
        let j = |k: usize| t.json(5, &u[k]);
        // (resolution, local, remote) in the order the changes were made.
        for (node, expect) in [
            (1, [("keep_local", j(3), j(0)), ("keep_local", j(3), j(2))]),
            (
                0,
                [("keep_local", j(2), j(1)), ("apply_remote", j(2), j(3))],
            ),
        ] {
            let got = c
                .rows(
                    node,
                    &format!(
                        "SELECT resolution, local_tuple::text, remote_tuple::text FROM mm.conflict_log \
                         WHERE relation = {} AND conflict_type = 'update_origin_differs' \
                         AND key = jsonb_build_object({}, 5) ORDER BY remote_commit_ts",
                        ql(&format!("public.{}", t.name)),
                        ql(&t.key)
                    ),
                )
                .await?;
            ensure!(
                got.len() == 2,
                "table {:?} on node {node}: {} conflicts on key 5, want 2: {got:?}",
                t.name,
                got.len()
            );
            for (row, (res, local, remote)) in got.iter().zip(&expect) {
                let parse = |v: &Option<String>| -> Option<Value> {
                    v.as_deref().and_then(|s| serde_json::from_str(s).ok())
                };
                ensure!(
                    row[0].as_deref() == Some(*res),
                    "table {:?} on node {node}: resolution {:?}, want {res}",
                    t.name,
                    row[0]
                );
                expect_tuple("hot key local", &parse(&row[1]), local)?;
                expect_tuple("hot key remote", &parse(&row[2]), remote)?;
            }
        }
    }
    // The second conflict of each table's key, in each direction, was
    // settled in place.
    let n = ts.len() as u64;
    let a = before(&c.stream_status("hid2", "hid1").await?) - a_before;
    let b = before(&c.stream_status("hid1", "hid2").await?) - b_before;
    ensure!(
        a == n && b == n,
        "conflicts settled in place: {a} into A, {b} into B, want {n} each"
    );
    Ok(())
}
