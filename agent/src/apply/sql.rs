//! SQL text for applying row changes. Pure functions, unit-tested.
//!
//! Identifiers come from the replication stream and are data: they are always
//! quoted here, never spliced raw. Values never appear in SQL text at all; they
//! are bound as parameters.

use std::fmt::Write;

/// The node-wide lock of careful (resolver) transactions, see
/// `Applier::apply_careful_once`. The key is ASCII "mm.care" in one bigint,
/// so it is unlikely to meet an application's own advisory locks.
pub const CAREFUL_LOCK: &str = "SELECT pg_catalog.pg_advisory_xact_lock(30800818464715365)";

/// Quotes an identifier the way PostgreSQL's `quote_ident` does when quoting is
/// needed, but always quotes (cheaper than deciding, and equally correct).
pub fn quote_ident(ident: &str) -> String {
    let mut out = String::with_capacity(ident.len() + 2);
    out.push('"');
    for c in ident.chars() {
        if c == '"' {
            out.push('"');
        }
        out.push(c);
    }
    out.push('"');
    out
}

pub fn qualified(schema: &str, table: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(table))
}

/// How the target row of an UPDATE/DELETE is found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Locator {
    /// By the local primary key / replica identity index columns (`=`).
    Key(Vec<String>),
    /// REPLICA IDENTITY FULL without a usable index: every listed column matched
    /// with IS NOT DISTINCT FROM, one row only (duplicates are legal there).
    AllColumns(Vec<String>),
}

fn where_clause(table: &str, loc: &Locator, first_param: usize, out: &mut String) {
    match loc {
        Locator::Key(cols) => {
            out.push_str(" WHERE ");
            for (i, c) in cols.iter().enumerate() {
                if i > 0 {
                    out.push_str(" AND ");
                }
                let _ = write!(out, "{} = ${}", quote_ident(c), first_param + i);
            }
        }
        Locator::AllColumns(cols) => {
            let _ = write!(out, " WHERE ctid = (SELECT ctid FROM {table} WHERE ");
            for (i, c) in cols.iter().enumerate() {
                if i > 0 {
                    out.push_str(" AND ");
                }
                let _ = write!(
                    out,
                    "{} IS NOT DISTINCT FROM ${}",
                    quote_ident(c),
                    first_param + i
                );
            }
            if cols.is_empty() {
                out.push_str("true");
            }
            out.push_str(" LIMIT 1 FOR UPDATE)");
        }
    }
}

/// `INSERT INTO t (c1, c2) OVERRIDING SYSTEM VALUE VALUES ($1, $2)`: the
/// publisher's values, also for `GENERATED ALWAYS AS IDENTITY` columns (a
/// no-op for tables without one).
pub fn insert(table: &str, cols: &[&str]) -> String {
    let mut s = format!("INSERT INTO {table} (");
    for (i, c) in cols.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&quote_ident(c));
    }
    s.push_str(") OVERRIDING SYSTEM VALUE VALUES (");
    for i in 0..cols.len() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "${}", i + 1);
    }
    s.push(')');
    s
}

/// `UPDATE t SET c1 = $1 ... WHERE <locator>`; SET params come first.
pub fn update(table: &str, set_cols: &[&str], loc: &Locator) -> String {
    let mut s = format!("UPDATE {table} SET ");
    for (i, c) in set_cols.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{} = ${}", quote_ident(c), i + 1);
    }
    where_clause(table, loc, set_cols.len() + 1, &mut s);
    s
}

/// `DELETE FROM t WHERE <locator>`.
pub fn delete(table: &str, loc: &Locator) -> String {
    let mut s = format!("DELETE FROM {table}");
    where_clause(table, loc, 1, &mut s);
    s
}

/// The guard parameters every fast-path UPDATE/DELETE appends after its own:
/// local origin id of the publisher, remote commit timestamp, watermark origin
/// ids and timestamps (see `mm.routine` in schema.rs).
pub const GUARD_PARAMS: usize = 4;

fn guard(first_param: usize) -> String {
    format!(
        "CASE WHEN mm.routine(xmin, ${}::oid[], ${}::timestamptz, ${}::oid[], ${}::timestamptz[]) THEN true ELSE mm.conflict() END",
        first_param,
        first_param + 1,
        first_param + 2,
        first_param + 3
    )
}

/// `jsonb_build_object('k1', <expr k1>, ...)`: a tombstone key, built from
/// typed values exactly as `mm.record_local_deletes` builds it from a row.
pub fn key_json(key_cols: &[&str], expr: impl Fn(usize, &str) -> String) -> String {
    let mut s = String::from("pg_catalog.jsonb_build_object(");
    for (i, c) in key_cols.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{}, {}", quote_literal(c), expr(i, c));
    }
    s.push(')');
    s
}

pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Fast-path INSERT of `rows` rows. A taken key fails it with a unique
/// violation. After every row went in, `mm.insert_recheck` (functions.sql)
/// raises `MM001` when a key has a tombstone or the table was truncated at
/// or after the remote commit timestamp (param `$rows*cols+1`); either way
/// the transaction is redone with the resolver. The checks run after the
/// insert, not in its WHERE, because the statement's snapshot misses a
/// delete (or truncate) committing while the insert runs or waits at an
/// index entry; the later check sees everything the earlier one would have.
/// `types` are the local column types, to type the params.
pub fn fast_insert(
    table: &str,
    cols: &[&str],
    types: &[&str],
    rows: usize,
    relid: u32,
    key_cols: Option<&[&str]>,
    commit: Commit,
) -> String {
    let names: Vec<String> = cols.iter().map(|c| quote_ident(c)).collect();
    let mut s = format!(
        "INSERT INTO {table} ({}) OVERRIDING SYSTEM VALUE VALUES ",
        names.join(", ")
    );
    let mut n = 0;
    for r in 0..rows {
        if r > 0 {
            s.push_str(", ");
        }
        s.push('(');
        for (i, ty) in types.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            n += 1;
            let _ = write!(s, "${n}::{ty}");
        }
        s.push(')');
    }
    // Unqualified names in RETURNING are the target's columns.
    let ret: Vec<String> = key_cols
        .unwrap_or(&[])
        .iter()
        .map(|c| quote_ident(c))
        .collect();
    if ret.is_empty() {
        s.push_str(" RETURNING 1");
    } else {
        let _ = write!(s, " RETURNING {}", ret.join(", "));
    }
    let recheck = insert_recheck(relid, key_cols, rows, n + 1);
    format!("WITH i AS ({s}){}", final_select(&recheck, commit))
}

/// The checks of a fast-path INSERT (its `i` CTE returns the keys), after
/// every row went in, with a fresh snapshot: `mm.insert_recheck`
/// (functions.sql says why). The first WHEN runs the insert to its end
/// (CASE evaluates in order, the InitPlan when first used), so the check
/// comes after any wait at an index entry. For many rows the keys are only
/// built when the table has a tombstone at all by then; for one, that test
/// would cost a function call as dear as the check itself.
///
/// One row with a key needs no wrapper: the function's argument, a scalar
/// subquery, reads `i` to its end (looking for a second row) before the
/// call. It goes to `mm.insert_recheck_key`, the same checks in a plan that
/// is cheaper to start for one key. Without a key, one row needs only EXISTS
/// (`i` has inserted its row once it returned it), cheaper than an
/// aggregate: single-row transactions are the backend-bound case.
fn insert_recheck(relid: u32, key_cols: Option<&[&str]>, rows: usize, ts_param: usize) -> String {
    let origins = ts_param + 1;
    let check = |keys: &str| {
        format!("mm.insert_recheck({relid}, {keys}, ${ts_param}::timestamptz, ${origins}::oid[])")
    };
    match key_cols {
        Some(keys) => {
            let key = key_json(keys, |_, c| format!("i.{}", quote_ident(c)));
            let all = format!("ARRAY(SELECT {key} FROM i)");
            if rows > 1 {
                let keys = format!("CASE WHEN mm.has_tombstones({relid}) THEN {all} END");
                format!(
                    "CASE WHEN (SELECT count(*) FROM i) < 0 THEN NULL ELSE {} END",
                    check(&keys)
                )
            } else {
                format!(
                    "mm.insert_recheck_key({relid}, (SELECT {key} FROM i), ${ts_param}::timestamptz, ${origins}::oid[])"
                )
            }
        }
        None if rows > 1 => format!(
            "CASE WHEN (SELECT count(*) FROM i) < 0 THEN NULL ELSE {} END",
            check("NULL::jsonb[]")
        ),
        None => format!(
            "CASE WHEN NOT EXISTS (SELECT FROM i) THEN NULL ELSE {} END",
            check("NULL::jsonb[]")
        ),
    }
}

/// Planner settings of every apply session, set before anything is
/// prepared. A merged statement (`fast_update_many`, `fast_delete_many`)
/// joins a VALUES list of up to a few hundred keys to the table, and its
/// plan is generic. Before the key bound (`key_join`), as a backlog of
/// deletes emptied a table, ANALYZE left it with its pages and few rows,
/// and a hash join over a sequential scan of all of it per statement
/// became cheapest in the planner's eyes (a 50k-row table at 8k rows
/// left; one bench run took 4x the backend CPU), so hash joins were off.
/// With the bound every scan of the table is by the statement's own keys,
/// and hashing the VALUES list is what the join needs: the nested loop
/// left as the only join compared every key with every row of a
/// materialized key scan, 100 x 100 per statement (half of a merged
/// 100-row DELETE's time, 0.5 of 1.1 ms on a scratch server; hashed
/// 0.2). Merge joins stay off: they would sort what a hash join need not.
pub const PLANNER_SETTINGS: [&str; 1] = ["SET enable_mergejoin = off"];

/// Parameters after a fast-path INSERT's row values: the remote commit
/// timestamp its truncate check compares against, and the publisher's
/// origin ids, whose truncates it passes (`mm.insert_recheck`).
pub const INSERT_EXTRA_PARAMS: usize = 2;

/// A remote TRUNCATE: `mm.apply_truncate(oids, remote commit ts, cascade,
/// restart identity)` (schema functions.sql).
pub const APPLY_TRUNCATE: &str =
    "SELECT mm.apply_truncate($1::oid[], $2::timestamptz, $3::boolean, $4::boolean)";

/// A TRUNCATE of one partition (`mm.truncate` message content, remote
/// commit ts): `mm.apply_partition_truncate`.
pub const APPLY_PARTITION_TRUNCATE: &str =
    "SELECT mm.apply_partition_truncate($1::jsonb, $2::timestamptz)";

/// The truncate version of a table: (roident, commit timestamp).
pub fn truncate_lookup(relid: u32) -> String {
    format!(
        "SELECT o.roident, o.\"timestamp\" FROM mm.truncates tr \
         LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(tr.xmin) o ON true \
         WHERE tr.relid = {relid}"
    )
}

/// Parameters the progress call of a one-statement transaction takes
/// (see `Commit::Fused`).
pub const PROGRESS_PARAMS: usize = 4;

/// How a fast-path row statement ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Commit {
    /// Inside an explicit transaction; COMMIT is a separate statement.
    Later,
    /// The transaction's only change: the statement also records progress
    /// (the progress guard, params from `first`) and runs as its own
    /// implicit transaction: one statement and one protocol round instead of
    /// BEGIN, change, progress, COMMIT. Single-row transactions are the
    /// common OLTP case and the apply backend is the bottleneck there.
    Fused { first: usize, lane: bool },
}

/// Parameters a fused statement in an apply lane takes after the progress
/// guard's (`lanes::Turn::fused_params`): `lane_turn`'s five (its own lock
/// as class and key, the lane's token class, the position it takes and
/// the one it lets go of), then the token position and lock key of the
/// transaction before it, which it waits for.
pub const LANE_PARAMS: usize = 7;

/// How long a transaction in an apply lane waits for any lock before it
/// fails, and is applied again alone, without a limit (`lanes.rs`: a
/// lane's token can be left held by a lane idle after a failure).
pub const LANE_LOCK_TIMEOUT: &str = "5s";

/// A lane transaction's first statement (`lanes.rs`): limits its lock
/// waits, takes its own lock `($1, $2)`, then its lane's token for the
/// next transaction `($3, $4)`, then lets go of its own token `($3, $5)`.
/// Session-level tokens outlive the transaction; the order makes sure a
/// waiter that got the token finds the lock taken.
pub fn lane_turn() -> String {
    format!(
        "SELECT pg_catalog.set_config('lock_timeout', '{LANE_LOCK_TIMEOUT}', true), \
         pg_catalog.pg_advisory_xact_lock($1::int4, $2::int4), \
         pg_catalog.pg_advisory_lock($3::int4, $4::int4), \
         pg_catalog.pg_advisory_unlock($3::int4, $5::int4)"
    )
}

/// Waits for the transaction before, in another lane: its lane's token
/// `($1, $2)` (held until it took its lock), then its lock `($3, $4)`
/// (held until it ended). Shared: several may wait for one.
pub const LANE_WAIT: &str = "SELECT pg_catalog.pg_advisory_xact_lock_shared($1::int4, $2::int4), \
     pg_catalog.pg_advisory_xact_lock_shared($3::int4, $4::int4)";

/// A lane's token at its first position, and after a failure: the session
/// lets go of every token first.
pub const LANE_TOKEN: &str =
    "SELECT pg_catalog.pg_advisory_unlock_all(), pg_catalog.pg_advisory_lock($1::int4, $2::int4)";

/// Lets go of every token of the session (lanes' failure path).
pub const LANE_RELEASE: &str = "SELECT pg_catalog.pg_advisory_unlock_all()";

/// The progress guard as a CTE named `mm_p`, params `$first..$first+3`:
/// origin, the previous transaction's end, this one's end, its commit
/// timestamp. Inlined rather than `mm.advance_progress()`: no function
/// call per transaction (plpgsql or SQL, either costs the apply backend a
/// executor setup per call; see `mm.advance_progress` for the rule).
///
/// In a lane (`lane`) the statement's snapshot predates the commit of the
/// transaction before it, which it waited for in the statement itself:
/// matched on that snapshot, `remote_lsn = prev` would not find the row.
/// The UPDATE then matches the origin alone, reaches the newest version
/// through READ COMMITTED's recheck (waiting for an uncommitted one), and
/// `RETURNING OLD` says whether that version was the previous end.
fn progress_cte(first: usize, lane: bool) -> String {
    progress_cte_of(first, lane, "1")
}

/// `progress_cte` counting `txns` applied transactions (an expression).
fn progress_cte_of(first: usize, lane: bool, txns: &str) -> String {
    let (o, prev, new, ts) = (first, first + 1, first + 2, first + 3);
    let (cond, ret) = if lane {
        (
            String::new(),
            format!("OLD.remote_lsn = ${prev}::pg_lsn AS mm_ok"),
        )
    } else {
        (format!(" AND remote_lsn = ${prev}::pg_lsn"), "1".to_owned())
    };
    format!(
        "mm_p AS (UPDATE mm.apply_progress SET remote_lsn = ${new}::pg_lsn, \
         remote_commit_ts = ${ts}::timestamptz, applied_txns = applied_txns + {txns} \
         WHERE origin = ${o}::text{cond} RETURNING {ret})"
    )
}

/// The guard's check (`mm.progress_one`: exactly one progress row moved,
/// else `mm_progress`, read as MM003) and the commit's origin timestamp.
fn progress_cols(first: usize, lane: bool) -> String {
    let moved = if lane {
        "COALESCE((SELECT 1::bigint FROM mm_p WHERE mm_p.mm_ok), 0)".to_owned()
    } else {
        rows_of_unique("mm_p")
    };
    format!(
        "{moved}::mm.progress_one, \
         pg_catalog.pg_replication_origin_xact_setup('0/0', ${}::timestamptz)",
        first + 3
    )
}

/// The number of rows (0 or 1) of a CTE that changed rows by a unique key,
/// as a bigint for the `mm.one_row` / `mm.progress_one` checks: a scalar
/// subquery, not `count(*)`, whose aggregate node costs the backend more
/// to set up than the row statement itself saves elsewhere; single-row
/// transactions are where the apply backend is the bottleneck. COALESCE is
/// grammar, not a function a user's schema could shadow.
fn rows_of_unique(cte: &str) -> String {
    format!("COALESCE((SELECT 1::bigint FROM {cte}), 0)")
}

/// A transaction's progress record on its own (params `$1..$4`).
pub fn advance_progress() -> String {
    format!(
        "WITH {} SELECT {}",
        progress_cte(1, false),
        progress_cols(1, false)
    )
}

/// A group's progress record (`group.rs`): as `advance_progress`, for the
/// `$5` transactions it applied together.
pub fn advance_group_progress() -> String {
    format!(
        "WITH {} SELECT {}",
        progress_cte_of(1, false, "$5::int4"),
        progress_cols(1, false)
    )
}

/// The final SELECT of a CTE-wrapped row statement: fails (`mm.one_row`)
/// unless `cte` returned exactly one row, and records progress when fused.
/// `loc` says whether at most one row can match: by a key it can, by all
/// columns (REPLICA IDENTITY FULL) duplicates can match and must be counted.
fn checked_select(cte: &str, loc: &Locator, commit: Commit) -> String {
    match (commit, loc) {
        (Commit::Later, _) => format!(" SELECT count(*)::mm.one_row FROM {cte}"),
        (Commit::Fused { .. }, Locator::Key(_)) => {
            final_select(&format!("{}::mm.one_row", rows_of_unique(cte)), commit)
        }
        (Commit::Fused { .. }, Locator::AllColumns(_)) => {
            final_select(&format!("(SELECT count(*) FROM {cte})::mm.one_row"), commit)
        }
    }
}

/// The SELECT ending a CTE-wrapped statement, returning `cols`; fused, the
/// progress CTE joins the WITH list and its check columns follow `cols`
/// (evaluated in order: the statement's own work first).
///
/// In a lane, the statement first takes its turn (`lane_turn`), around the
/// first column so that column stays the statement's own result, and waits
/// for the transaction before (`LANE_WAIT`) after its own work: two lanes'
/// row changes run at once, their commits one after the other.
fn final_select(cols: &str, commit: Commit) -> String {
    match commit {
        Commit::Later => format!(" SELECT {cols}"),
        Commit::Fused { first, lane: false } => format!(
            ", {} SELECT {cols}, {}",
            progress_cte(first, false),
            progress_cols(first, false)
        ),
        Commit::Fused { first, lane: true } => {
            let p = |k: usize| format!("${}::int4", first + PROGRESS_PARAMS + k);
            let (class, own, tok, next, cur, prev_pos, prev_key) =
                (p(0), p(1), p(2), p(3), p(4), p(5), p(6));
            format!(
                ", {} SELECT CASE WHEN pg_catalog.set_config('lock_timeout', '{LANE_LOCK_TIMEOUT}', true) IS NULL THEN NULL \
                 WHEN pg_catalog.pg_advisory_xact_lock({class}, {own}) IS NULL THEN NULL \
                 WHEN pg_catalog.pg_advisory_lock({tok}, {next}) IS NULL THEN NULL \
                 WHEN pg_catalog.pg_advisory_unlock({tok}, {cur}) IS NULL THEN NULL ELSE {cols} END, \
                 pg_catalog.pg_advisory_xact_lock_shared({tok}, {prev_pos}), \
                 pg_catalog.pg_advisory_xact_lock_shared({class}, {prev_key}), {}",
                progress_cte(first, true),
                progress_cols(first, true)
            )
        }
    }
}

/// Fast-path UPDATE: changes the row only when `mm.routine` says no resolver
/// is needed; raises `MM001` otherwise (or when the row is missing).
pub fn fast_update(
    table: &str,
    set_cols: &[&str],
    loc: &Locator,
    loc_params: usize,
    commit: Commit,
) -> String {
    let mut s = update(table, set_cols, loc);
    let first = set_cols.len() + loc_params + 1;
    let _ = write!(s, " AND {} RETURNING 1", guard(first));
    format!("WITH u AS ({s}){}", checked_select("u", loc, commit))
}

/// Parameters a resolving UPDATE (`fast_update_in_place`) takes after the
/// guard's: relation (`schema.table`), commit LSN, publisher's node name,
/// this node's name, local origin ids and their node names.
pub const IN_PLACE_PARAMS: usize = 6;

/// Fast-path UPDATE of a key that just conflicted (`apply/hot.rs`), with
/// the conflict resolved in the statement instead of by a rolled-back
/// attempt and the careful path ("check, then apply"): the one conflict it
/// settles is `update_origin_differs` under last-writer-wins, the row found
/// by its key, every column sent. It locks the row (`FOR UPDATE`: the
/// newest committed version, as the careful path's `fetch_rows` reads it,
/// with that version's commit timestamp and origin read in the locking
/// query's select list, never from a join: see `fetch_rows`), decides
/// routine / remote wins / local wins by the same rules
/// (`mm.routine_full` written out over the version's commit timestamp and
/// origin the statement reads anyway: the function call and its two
/// further lookups of them were half of what a resolution cost over a
/// plain update; `Conflict::remote_is_later`; names compared
/// bytewise, `COLLATE "C"`, as Rust compares them), updates only when the
/// remote change wins and logs the conflict exactly as the careful path
/// would. Anything else, a row missing, an update that did not take the
/// locked version, raises `MM001` and the careful path takes over; a
/// unique collision raises 23505 as on the plain fast path. Its first
/// column is the number of conflicts it logged (0 or 1).
///
/// Params: `$1..$n` every column's new value (`types`), then the key
/// values, the guard's four, `IN_PLACE_PARAMS`, and the progress
/// guard's when fused.
pub fn fast_update_in_place(
    table: &str,
    cols: &[&str],
    types: &[&str],
    key_cols: &[&str],
    commit: Commit,
) -> String {
    let n = cols.len();
    let loc = Locator::Key(key_cols.iter().map(|c| (*c).to_owned()).collect());
    let g = n + key_cols.len() + 1;
    let (peer_oid, ts, wm_ids, wm_ts) = (g, g + 1, g + 2, g + 3);
    let e = g + GUARD_PARAMS;
    let (relation, lsn, peer, local, ids, names) = (e, e + 1, e + 2, e + 3, e + 4, e + 5);
    let typed = |i: usize| format!("${}::{}", i + 1, types[i]);
    let mut set = String::new();
    let mut remote = String::new();
    for (i, c) in cols.iter().enumerate() {
        if i > 0 {
            set.push_str(", ");
            remote.push_str(", ");
        }
        let _ = write!(set, "{} = {}", quote_ident(c), typed(i));
        let _ = write!(remote, "{} AS {}", typed(i), quote_ident(c));
    }
    let mut key_where = String::new();
    where_clause(table, &loc, n + 1, &mut key_where);
    let key = key_json(key_cols, |_, c| format!("n.{}", quote_ident(c)));
    let decision = "(SELECT d.mm_decision FROM mm_d AS d)";
    format!(
        "WITH mm_l AS MATERIALIZED (SELECT \
         pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS mm_o, pg_catalog.to_jsonb(r.*) AS mm_row \
         FROM {table} AS r WHERE {} FOR UPDATE OF r), \
         mm_c AS MATERIALIZED (SELECT \
         CASE WHEN (l.mm_o).\"timestamp\" IS NULL OR (l.mm_o).roident = ANY (${peer_oid}::oid[]) THEN true \
         WHEN (l.mm_o).\"timestamp\" <= (${wm_ts}::timestamptz[])[pg_catalog.array_position(${wm_ids}::oid[], (l.mm_o).roident)] \
         AND (l.mm_o).\"timestamp\" < ${ts}::timestamptz THEN mm.count_routine() \
         ELSE false END AS mm_routine, \
         (l.mm_o).\"timestamp\" AS mm_ts, \
         CASE WHEN (l.mm_o).roident = 0 THEN ${local}::text ELSE COALESCE((${names}::text[])[pg_catalog.array_position(${ids}::oid[], (l.mm_o).roident)], \
         'origin ' || (l.mm_o).roident::text) END AS mm_origin, \
         l.mm_row FROM mm_l AS l), \
         mm_d AS MATERIALIZED (SELECT c.mm_ts, c.mm_origin, c.mm_row, \
         CASE WHEN c.mm_routine THEN 0 \
         WHEN ROW(${ts}::timestamptz, ${peer}::text COLLATE \"C\") > ROW(c.mm_ts, c.mm_origin COLLATE \"C\") THEN 1 \
         ELSE 2 END AS mm_decision FROM mm_c AS c), \
         u AS (UPDATE {table} SET {set}{key_where} AND {decision} < 2 RETURNING 1), \
         lg AS (INSERT INTO mm.conflict_log (relation, conflict_type, key, local_origin, local_commit_ts, \
         remote_origin, remote_commit_ts, remote_lsn, resolution, local_tuple, remote_tuple) \
         SELECT ${relation}::text, 'update_origin_differs', {key}, d.mm_origin, d.mm_ts, ${peer}::text, \
         ${ts}::timestamptz, ${lsn}::pg_lsn, \
         CASE WHEN d.mm_decision = 1 THEN 'apply_remote' ELSE 'keep_local' END, d.mm_row, pg_catalog.to_jsonb(n.*) \
         FROM mm_d AS d, (SELECT {remote}) AS n WHERE d.mm_decision > 0 RETURNING 1){}",
        where_alias(&loc, n + 1),
        final_select(
            &format!(
                "CASE WHEN {decision} IS NULL OR ({decision} < 2 AND NOT EXISTS (SELECT FROM u)) \
                 THEN mm.conflict()::pg_catalog.int4 \
                 ELSE {}::pg_catalog.int4 END",
                rows_of_unique("lg")
            ),
            commit
        )
    )
}

/// Fast-path DELETE: deletes when `mm.routine` allows and leaves a tombstone
/// (tables with a key, written as `tombstones` says) in the same statement;
/// raises `MM001` otherwise.
pub fn fast_delete(
    table: &str,
    loc: &Locator,
    loc_params: usize,
    relid: u32,
    key_cols: Option<&[&str]>,
    commit: Commit,
    tombstones: TombstoneWrite,
) -> String {
    let mut s = delete(table, loc);
    let _ = write!(s, " AND {}", guard(loc_params + 1));
    match key_cols {
        Some(keys) => {
            let ret: Vec<String> = keys.iter().map(|c| quote_ident(c)).collect();
            let key = key_json(keys, |_, c| format!("d.{}", quote_ident(c)));
            format!(
                "WITH d AS ({s} RETURNING {}){}{}",
                ret.join(", "),
                tombstones.cte(relid, &key),
                checked_select("d", loc, commit)
            )
        }
        None => format!(
            "WITH d AS ({s} RETURNING 1){}",
            checked_select("d", loc, commit)
        ),
    }
}

/// Parameters a merged UPDATE/DELETE (`fast_update_many`,
/// `fast_delete_many`) takes after its rows': the guard's shared ones,
/// the publisher's local origin ids and the watermark's origin ids and
/// timestamps (each row carries its own commit timestamp).
pub const MANY_EXTRA_PARAMS: usize = 3;

/// `mm_v (mm_1, .., mm_ts) AS (VALUES ($1::t1, .., $w::timestamptz), ..)`:
/// a merged statement's rows, each `types` then its commit timestamp. The
/// column names are ours, never a user's: a user's column is only ever
/// named on the target table's alias.
fn values_cte(types: &[&str], rows: usize) -> String {
    let mut s = String::from("mm_v (");
    for i in 1..=types.len() {
        let _ = write!(s, "mm_{i}, ");
    }
    s.push_str("mm_ts) AS (VALUES ");
    let mut n = 0;
    for r in 0..rows {
        if r > 0 {
            s.push_str(", ");
        }
        s.push('(');
        for ty in types.iter().copied().chain(std::iter::once("timestamptz")) {
            if n % (types.len() + 1) > 0 {
                s.push_str(", ");
            }
            n += 1;
            let _ = write!(s, "${n}::{ty}");
        }
        s.push(')');
    }
    s.push(')');
    s
}

/// `mm_t."k1" = mm_v.mm_{first} AND ..`: the target row of a merged row,
/// and each key column bounded by the statement's own keys
/// (`= ANY (ARRAY(SELECT ..))`, an index condition in any join order).
///
/// Why the bound: ANALYZE running while a large transaction inserts into
/// the table (autovacuum, during a careful-path load or a big remote
/// transaction) records its pages with no live rows, and the planner then
/// takes the table for one row: it joins by scanning the whole key index
/// as the outer side and filtering every row against the VALUES list, per
/// statement, until the next ANALYZE. One bench run of grouped DELETEs took
/// 39-42 s instead of ~1 s that way (40 ms per 100-row statement). With the
/// bound that plan reads only the statement's keys (~1 ms); with sane
/// statistics the plan is the usual one (VALUES outer, key index inner),
/// where the bound costs each probe its array: ~10% of a merged DELETE's
/// backend CPU (33 -> 37 ticks per 50k rows, five rounds on a scratch
/// server), taken as the price of never falling off that cliff.
fn key_join(key_cols: &[&str], first: usize) -> String {
    let mut s = String::new();
    for (i, c) in key_cols.iter().enumerate() {
        let col = quote_ident(c);
        let v = first + i;
        let _ = write!(
            s,
            "mm_t.{col} = mm_v.mm_{v} AND mm_t.{col} = ANY (ARRAY(SELECT mm_b.mm_{v} FROM mm_v AS mm_b)) AND "
        );
    }
    s
}

/// The guard of a merged row: `mm.routine` with the row's own commit
/// timestamp and the shared parameters from `$first`.
fn many_guard(first: usize) -> String {
    format!(
        "CASE WHEN mm.routine(mm_t.xmin, ${first}::oid[], mm_v.mm_ts, ${}::oid[], ${}::timestamptz[]) THEN true ELSE mm.conflict() END",
        first + 1,
        first + 2
    )
}

/// Fails (`mm.one_row`, read as a conflict) unless `cte` changed exactly
/// `rows` rows: a row missing or changed twice is redone one transaction
/// at a time, where the careful path names it.
fn all_rows(cte: &str, rows: usize) -> String {
    format!(
        " SELECT (CASE WHEN (SELECT count(*) FROM {cte}) = {rows} THEN 1 ELSE 0 END)::mm.one_row"
    )
}

/// `rows` fast-path UPDATEs of one table, with distinct keys and the same
/// columns set, in one statement (a group's, `merge.rs`): each row is
/// changed only when `mm.routine` says its own change is routine, as
/// `fast_update` would. Params: per row the `set_cols` values, the key
/// values and the commit timestamp; then `MANY_EXTRA_PARAMS`.
pub fn fast_update_many(
    table: &str,
    set_cols: &[&str],
    set_types: &[&str],
    key_cols: &[&str],
    key_types: &[&str],
    rows: usize,
) -> String {
    let types: Vec<&str> = set_types.iter().chain(key_types).copied().collect();
    let mut set = String::new();
    for (i, c) in set_cols.iter().enumerate() {
        if i > 0 {
            set.push_str(", ");
        }
        let _ = write!(set, "{} = mm_v.mm_{}", quote_ident(c), i + 1);
    }
    format!(
        "WITH {}, u AS (UPDATE {table} AS mm_t SET {set} FROM mm_v WHERE {}{} RETURNING 1){}",
        values_cte(&types, rows),
        key_join(key_cols, set_cols.len() + 1),
        many_guard(rows * (types.len() + 1) + 1),
        all_rows("u", rows)
    )
}

/// How a statement writes the tombstones of the keys it deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TombstoneWrite {
    /// `ON CONFLICT .. DO UPDATE`: raises the tombstone a key already has
    /// (deleted again before the purge took its last one).
    Upsert,
    /// A plain INSERT, for keys that have no tombstone. A third of an
    /// upsert's cost per row (no speculative insertion, whose per-row
    /// token lock is most of it: 100-row merged deletes 0.8 -> 0.4 ms of
    /// tombstone writing per statement on a scratch server). A key that
    /// has one fails the statement on the table's key (23505,
    /// `Signal::TombstoneTaken`): it is redone as a conflict, and that
    /// table's merged deletes upsert for a while (`recover`).
    Insert,
    /// None at all: the deleting origin is this node's only peer
    /// (`Watermarks::sole_peer`). Only a change from a third node that had
    /// not seen the delete ever reads a remote delete's tombstone (the
    /// publisher's later changes come after it, this node's own writes are
    /// not judged here), which is also why the purge takes such tombstones
    /// at once (`Watermarks::purge_cutoffs`). Writing them cost the apply
    /// backend a heap and an index insert per deleted row, the purge a
    /// delete of each, and this node's walsender their WAL to decode and
    /// drop: a 100k single-row DELETE backlog (default settings) took 2.6-2.9
    /// s of backend CPU with them, 1.7-1.8 without.
    Skip,
}

/// Raises a key's existing tombstone to the writing transaction. The
/// conflict target is `mm_tombstones_key`'s (0008_tombstone_hash.sql): the
/// key's hash, then the key.
const TOMBSTONE_UPSERT: &str = " ON CONFLICT (relid, pg_catalog.jsonb_hash_extended(key, 0), key) \
                                DO UPDATE SET relid = EXCLUDED.relid";

impl TombstoneWrite {
    /// The `tb` CTE writing the tombstones of the keys deleted in `d`
    /// (`key`, built from `d`'s columns), with the comma before it; empty
    /// when none are written.
    fn cte(self, relid: u32, key: &str) -> String {
        self.insert(relid, key)
            .map(|i| format!(", tb AS ({i})"))
            .unwrap_or_default()
    }

    /// The INSERT of the tombstones of the keys deleted in `d`, if any.
    fn insert(self, relid: u32, key: &str) -> Option<String> {
        let clause = match self {
            TombstoneWrite::Upsert => TOMBSTONE_UPSERT,
            TombstoneWrite::Insert => "",
            TombstoneWrite::Skip => return None,
        };
        Some(format!(
            "INSERT INTO mm.tombstones (relid, key) SELECT {relid}, {key} FROM d{clause}"
        ))
    }
}

/// What a keyed DELETE of `mm_t` returns (its key columns) and the
/// tombstone key built from them in its CTE `d`.
fn deleted_keys(key_cols: &[&str]) -> (Vec<String>, String) {
    let ret = key_cols
        .iter()
        .map(|c| format!("mm_t.{}", quote_ident(c)))
        .collect();
    (
        ret,
        key_json(key_cols, |_, c| format!("d.{}", quote_ident(c))),
    )
}

/// `rows` fast-path DELETEs of one table by distinct keys in one statement
/// (`merge.rs`), each guarded as `fast_delete`'s, with their tombstones
/// written as `tombstones` says. Params: per row the key values and the
/// commit timestamp; then `MANY_EXTRA_PARAMS`.
pub fn fast_delete_many(
    table: &str,
    key_cols: &[&str],
    key_types: &[&str],
    relid: u32,
    rows: usize,
    tombstones: TombstoneWrite,
) -> String {
    let (ret, key) = deleted_keys(key_cols);
    format!(
        "WITH {}, d AS (DELETE FROM {table} AS mm_t USING mm_v WHERE {}{} RETURNING {}){}{}",
        values_cte(key_types, rows),
        key_join(key_cols, 1),
        many_guard(rows * (key_types.len() + 1) + 1),
        ret.join(", "),
        tombstones.cte(relid, &key),
        all_rows("d", rows)
    )
}

/// Upserts the tombstone of one key (params `$1..` typed by `types`).
pub fn tombstone_upsert(relid: u32, key_cols: &[&str], types: &[&str]) -> String {
    let key = key_json(key_cols, |i, _| format!("${}::{}", i + 1, types[i]));
    format!("INSERT INTO mm.tombstones (relid, key) VALUES ({relid}, {key}){TOMBSTONE_UPSERT}")
}

/// The tombstone of one key with its version: (roident, commit timestamp).
pub fn tombstone_lookup(relid: u32, key_cols: &[&str], types: &[&str]) -> String {
    let key = key_json(key_cols, |i, _| format!("${}::{}", i + 1, types[i]));
    format!(
        "SELECT o.roident, o.\"timestamp\" FROM mm.tombstones tb \
         LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(tb.xmin) o ON true \
         WHERE tb.relid = {relid} AND pg_catalog.jsonb_hash_extended(tb.key, 0) = \
         pg_catalog.jsonb_hash_extended({key}, 0) AND tb.key = {key}"
    )
}

/// Locked local rows matching `where_sql` (over alias `r`), each with its
/// version: where it is (`tableoid:ctid`: a ctid alone is not unique in a
/// partitioned table), row as jsonb, origin id, commit timestamp, and whether this
/// transaction wrote it.
///
/// The version's origin and timestamp are read in the select list, never
/// from a join (`LATERAL pg_xact_commit_timestamp_origin(r.xmin)`): when
/// the row was updated after the statement's snapshot, FOR UPDATE locks
/// the newest version and PostgreSQL recomputes the select list over it,
/// but returns a joined function's row as first computed, for the version
/// before. Conflicts would be judged against a version that is gone.
pub fn fetch_rows(table: &str, where_sql: &str) -> String {
    format!(
        "SELECT r.tableoid::oid::text || ':' || r.ctid::text, pg_catalog.to_jsonb(r.*), \
         (pg_catalog.pg_xact_commit_timestamp_origin(r.xmin)).roident, \
         (pg_catalog.pg_xact_commit_timestamp_origin(r.xmin)).\"timestamp\", \
         r.xmin = pg_catalog.pg_current_xact_id()::xid \
         FROM {table} AS r WHERE {where_sql} FOR UPDATE OF r"
    )
}

/// WHERE text over alias `r` for a locator, params from `first_param`.
pub fn where_alias(loc: &Locator, first_param: usize) -> String {
    let mut s = String::new();
    match loc {
        Locator::Key(cols) => {
            for (i, c) in cols.iter().enumerate() {
                if i > 0 {
                    s.push_str(" AND ");
                }
                let _ = write!(s, "r.{} = ${}", quote_ident(c), first_param + i);
            }
        }
        Locator::AllColumns(cols) => {
            for (i, c) in cols.iter().enumerate() {
                if i > 0 {
                    s.push_str(" AND ");
                }
                let _ = write!(
                    s,
                    "r.{} IS NOT DISTINCT FROM ${}",
                    quote_ident(c),
                    first_param + i
                );
            }
            if cols.is_empty() {
                s.push_str("true");
            }
        }
    }
    s
}

/// A tuple as jsonb, typed like the local columns: `to_jsonb` of a row of
/// casts, so it reads exactly like a local row's jsonb.
pub fn row_json(cols: &[&str], types: &[&str]) -> String {
    let mut s = String::from("SELECT pg_catalog.to_jsonb(x.*) FROM (SELECT ");
    for (i, (c, ty)) in cols.iter().zip(types).enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "${}::{} AS {}", i + 1, ty, quote_ident(c));
    }
    s.push_str(") x");
    s
}

/// Inserts the row given as jsonb `$1` (a resolver's merged row).
pub fn insert_json(table: &str, cols: &[&str]) -> String {
    let names: Vec<String> = cols.iter().map(|c| quote_ident(c)).collect();
    let names = names.join(", ");
    format!(
        "INSERT INTO {table} ({names}) OVERRIDING SYSTEM VALUE SELECT {names} FROM pg_catalog.jsonb_populate_record(NULL::{table}, $1::jsonb)"
    )
}

/// `tableoid:ctid` (as `fetch_rows` gives it) in param `$n`.
/// `tableoid:ctid` in param `$n` (as `fetch_rows` returns it) as a WHERE.
pub fn at_row(n: usize) -> String {
    format!(
        "tableoid = pg_catalog.split_part(${n}, ':', 1)::oid AND ctid = pg_catalog.split_part(${n}, ':', 2)::tid"
    )
}

/// Overwrites the row at `$2` (`tableoid:ctid`) with the jsonb row `$1`.
pub fn update_json(table: &str, cols: &[&str]) -> String {
    let names: Vec<String> = cols.iter().map(|c| quote_ident(c)).collect();
    let names = names.join(", ");
    format!(
        "UPDATE {table} SET ({names}) = (SELECT {names} FROM pg_catalog.jsonb_populate_record(NULL::{table}, $1::jsonb)) WHERE {}",
        at_row(2)
    )
}

/// Deletes the row at `$1` (`tableoid:ctid`).
pub fn delete_ctid(table: &str) -> String {
    format!("DELETE FROM {table} WHERE {}", at_row(1))
}

/// One row change of each transaction a batch procedure applies
/// (`batch.rs`): the row statement as the fast path runs it, over the procedure's
/// per-transaction arrays (`mm_c<n>[mm_i]`, each cast to its column's
/// local type, as the fast path casts its text parameters).
#[derive(Debug, Clone)]
pub enum BatchChange<'a> {
    /// Every column (`cols` with `types`), the key's for the re-check.
    Insert {
        cols: &'a [&'a str],
        types: &'a [&'a str],
        key_cols: &'a [&'a str],
    },
    /// SET `set_cols` (arrays 1..), then the row by `key_cols` (arrays after).
    Update {
        set_cols: &'a [&'a str],
        set_types: &'a [&'a str],
        key_cols: &'a [&'a str],
        key_types: &'a [&'a str],
    },
    /// The row by `key_cols`, its tombstone written as `tombstones` says.
    Delete {
        key_cols: &'a [&'a str],
        key_types: &'a [&'a str],
        tombstones: TombstoneWrite,
    },
}

impl BatchChange<'_> {
    /// The text arrays the procedure takes after `BATCH_FIXED_PARAMS`.
    pub fn arrays(&self) -> usize {
        match self {
            BatchChange::Insert { cols, .. } => cols.len(),
            BatchChange::Update {
                set_cols, key_cols, ..
            } => set_cols.len() + key_cols.len(),
            BatchChange::Delete { key_cols, .. } => key_cols.len(),
        }
    }
}

/// The procedure's parameters before its value arrays: the progress
/// origin, the progress before the first transaction, the publisher's
/// origin ids, the watermark's origin ids and timestamps (shared by the
/// batch), then per transaction its end LSN and commit timestamp.
pub const BATCH_FIXED_PARAMS: usize = 7;

/// The value arrays a batch procedure may take: a function or procedure
/// has at most `FUNC_MAX_ARGS` (100 in every stock build of PostgreSQL)
/// arguments, its fixed ones included. A wider shape is not batched.
pub const BATCH_MAX_ARRAYS: usize = 100 - BATCH_FIXED_PARAMS;

/// `mm_t."k1" = mm_c<first>[mm_i]::t1 AND ..`: the row a batch's change
/// targets, by its key.
fn batch_key_match(key_cols: &[&str], key_types: &[&str], first: usize) -> String {
    let mut s = String::new();
    for (i, (c, ty)) in key_cols.iter().zip(key_types).enumerate() {
        let _ = write!(
            s,
            "mm_t.{} = mm_c{}[mm_i]::{ty} AND ",
            quote_ident(c),
            first + i
        );
    }
    s
}

const BATCH_GUARD: &str = "CASE WHEN mm.routine(mm_t.xmin, mm_origins, mm_ts[mm_i], mm_wm_ids, mm_wm_ts) \
                           THEN true ELSE mm.conflict() END";

/// One row change of every transaction a batch procedure applies: its
/// table (SQL name and oid, for tombstones and the re-check) and how.
#[derive(Debug, Clone)]
pub struct BatchStep<'a> {
    pub table: &'a str,
    pub relid: u32,
    pub change: BatchChange<'a>,
}

/// The insert re-check of `mm.insert_recheck_key` (functions.sql) for the
/// key in variable `key` of table `relid`, written out for the batch
/// procedure's progress record, so it runs as part of that statement's
/// cached plan (two init plans) instead of as an SQL function whose
/// executor the procedure sets up again after every COMMIT: backend CPU
/// of a 100k UPDATE+INSERT backlog 4.2-4.3 -> 3.6-3.7 s in the bench; of a
/// single-row INSERT's loop ~1.3 of ~25 us (scratch server, 30k
/// transactions per variant). The progress record is a
/// statement of its own after the transaction's row changes, so it reads
/// the tombstones and truncates with a snapshot taken after the insert,
/// the fresh snapshot the function exists for. Keep the two in step: the
/// same two conditions, the same raise.
fn batch_insert_recheck(relid: u32, key: &str) -> String {
    format!(
        " AND CASE WHEN EXISTS (SELECT FROM mm.truncates tr WHERE tr.relid = {relid} \
         AND (pg_catalog.pg_xact_commit_timestamp_origin(tr.xmin)).\"timestamp\" >= mm_ts[mm_i] \
         AND (pg_catalog.pg_xact_commit_timestamp_origin(tr.xmin)).roident <> ALL (mm_origins)) \
         OR EXISTS (SELECT FROM mm.tombstones tb WHERE tb.relid = {relid} \
         AND pg_catalog.jsonb_hash_extended(tb.key, 0) = pg_catalog.jsonb_hash_extended({key}, 0) \
         AND tb.key = {key}) THEN mm.conflict() ELSE true END"
    )
}

/// The statements of `step` (the `n`th of its transaction) in the
/// procedure's loop, its value arrays numbered from `mm_c<first>`. An
/// insert whose re-check may wait for the progress record (`fold`) adds
/// it there (`recheck`); otherwise it runs right after the insert.
fn batch_row(
    step: &BatchStep<'_>,
    first: usize,
    n: usize,
    fold: bool,
    recheck: &mut String,
) -> String {
    let (table, relid) = (step.table, step.relid);
    let arr = |i: usize| format!("mm_c{}[mm_i]", first + i);
    match &step.change {
        BatchChange::Insert {
            cols,
            types,
            key_cols,
        } => {
            let names: Vec<String> = cols.iter().map(|c| quote_ident(c)).collect();
            let values: Vec<String> = types
                .iter()
                .enumerate()
                .map(|(i, ty)| format!("{}::{ty}", arr(i)))
                .collect();
            let key = key_json(key_cols, |_, c| format!("mm_t.{}", quote_ident(c)));
            let var = format!("mm_key{n}");
            let check = if fold {
                recheck.push_str(&batch_insert_recheck(relid, &var));
                String::new()
            } else {
                format!(
                    "\n    PERFORM mm.insert_recheck_key({relid}, {var}, mm_ts[mm_i], mm_origins);"
                )
            };
            format!(
                "INSERT INTO {table} AS mm_t ({}) OVERRIDING SYSTEM VALUE VALUES ({}) \
                 RETURNING {key} INTO {var};{check}",
                names.join(", "),
                values.join(", ")
            )
        }
        BatchChange::Update {
            set_cols,
            set_types,
            key_cols,
            key_types,
        } => {
            let set: Vec<String> = set_cols
                .iter()
                .zip(*set_types)
                .enumerate()
                .map(|(i, (c, ty))| format!("{} = {}::{ty}", quote_ident(c), arr(i)))
                .collect();
            format!(
                "UPDATE {table} AS mm_t SET {} WHERE {}{BATCH_GUARD};\n    \
                 IF NOT FOUND THEN PERFORM 0::mm.one_row; END IF;",
                set.join(", "),
                batch_key_match(key_cols, key_types, first + set_cols.len())
            )
        }
        BatchChange::Delete {
            key_cols,
            key_types,
            tombstones,
        } => {
            let (ret, key) = deleted_keys(key_cols);
            let delete = format!(
                "DELETE FROM {table} AS mm_t WHERE {}{BATCH_GUARD}",
                batch_key_match(key_cols, key_types, first)
            );
            let statement = match tombstones.insert(relid, &key) {
                Some(insert) => {
                    format!("WITH d AS ({delete} RETURNING {}) {insert}", ret.join(", "))
                }
                None => delete,
            };
            format!("{statement};\n    IF NOT FOUND THEN PERFORM 0::mm.one_row; END IF;")
        }
    }
}

/// The signature and body of a batch procedure (after `CREATE PROCEDURE
/// <name>`): applies each transaction of the batch, its row changes
/// (`steps`) in order, as the fast path would (`fast_insert`,
/// `fast_update`, `fast_delete`, with their checks), and commits it on its
/// own: its progress record, its
/// commit timestamp through the origin, COMMIT. A failure raises the same
/// error the fused statement would (`mm.one_row`, `mm.progress_one`,
/// `mm.conflict()`, the table's own), rolling back only the transaction
/// it met; those before it stay committed (their progress says so).
///
/// Names: the procedure's variables are all `mm_`-prefixed and
/// `#variable_conflict use_variable` makes them win over any column; a
/// user's column is only ever named qualified (`mm_t."c"`, `d."c"`) or
/// where no variable can stand (an INSERT's column list, a SET target),
/// so no user identifier can capture one of ours, nor ours a user's.
/// The body is dollar-quoted with a tag it does not contain.
pub fn batch_procedure(steps: &[BatchStep<'_>]) -> String {
    let arrays: usize = steps.iter().map(|s| s.change.arrays()).sum();
    let mut sig = String::from(
        "(mm_o text, mm_prev pg_lsn, mm_origins oid[], mm_wm_ids oid[], \
         mm_wm_ts timestamptz[], mm_end pg_lsn[], mm_ts timestamptz[]",
    );
    for n in 1..=arrays {
        let _ = write!(sig, ", mm_c{n} text[]");
    }
    sig.push(')');
    let mut rows = Vec::with_capacity(steps.len());
    let (mut first, mut recheck, mut keys) = (1, String::new(), String::new());
    for (n, step) in steps.iter().enumerate() {
        // A delete later in the same transaction writes a tombstone the
        // insert's own re-check must not see: that insert checks at once.
        let fold = !steps[n + 1..]
            .iter()
            .any(|s| matches!(s.change, BatchChange::Delete { .. }));
        rows.push(batch_row(step, first, n, fold, &mut recheck));
        if matches!(step.change, BatchChange::Insert { .. }) {
            let _ = write!(keys, "\n  mm_key{n} jsonb;");
        }
        first += step.change.arrays();
    }
    let row = rows.join("\n    ");
    let body = format!(
        "\n#variable_conflict use_variable\nDECLARE\n  mm_i int;{keys}\nBEGIN\n  \
         FOR mm_i IN 1 .. pg_catalog.array_length(mm_end, 1) LOOP\n    {row}\n    \
         UPDATE mm.apply_progress SET remote_lsn = mm_end[mm_i], remote_commit_ts = mm_ts[mm_i], \
         applied_txns = applied_txns + 1 WHERE origin = mm_o AND remote_lsn = mm_prev{recheck};\n    \
         IF NOT FOUND THEN PERFORM 0::mm.progress_one; END IF;\n    \
         mm_prev := mm_end[mm_i];\n    \
         PERFORM pg_catalog.pg_replication_origin_xact_setup('0/0', mm_ts[mm_i]);\n    \
         COMMIT;\n  END LOOP;\nEND\n"
    );
    let mut n = 0;
    let tag = loop {
        let t = format!("$mm_batch{n}$");
        if !body.contains(&t) {
            break t;
        }
        n += 1;
    };
    format!("{sig} LANGUAGE plpgsql AS {tag}{body}{tag}")
}

/// The CALL of batch procedure `name` taking `arrays` value arrays.
pub fn batch_call(name: &str, arrays: usize) -> String {
    let mut s = format!(
        "CALL {name}($1::text, $2::pg_lsn, $3::oid[], $4::oid[], $5::timestamptz[], \
         $6::pg_lsn[], $7::timestamptz[]"
    );
    for n in 1..=arrays {
        let _ = write!(s, ", ${}::text[]", BATCH_FIXED_PARAMS + n);
    }
    s.push(')');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_always_quoted_and_escaped() {
        assert_eq!(quote_ident("t"), "\"t\"");
        assert_eq!(quote_ident("we\"ird; DROP"), "\"we\"\"ird; DROP\"");
        assert_eq!(qualified("s", "T"), "\"s\".\"T\"");
    }

    #[test]
    fn a_groups_progress_counts_its_transactions_and_keeps_the_guard() {
        assert_eq!(
            advance_group_progress(),
            "WITH mm_p AS (UPDATE mm.apply_progress SET remote_lsn = $3::pg_lsn, \
             remote_commit_ts = $4::timestamptz, applied_txns = applied_txns + $5::int4 \
             WHERE origin = $1::text AND remote_lsn = $2::pg_lsn RETURNING 1) \
             SELECT COALESCE((SELECT 1::bigint FROM mm_p), 0)::mm.progress_one, \
             pg_catalog.pg_replication_origin_xact_setup('0/0', $4::timestamptz)"
        );
        assert!(advance_progress().contains("applied_txns = applied_txns + 1 "));
    }

    #[test]
    fn insert_update_delete_text() {
        let t = qualified("public", "acc");
        assert_eq!(
            insert(&t, &["id", "v"]),
            "INSERT INTO \"public\".\"acc\" (\"id\", \"v\") OVERRIDING SYSTEM VALUE VALUES ($1, $2)"
        );
        let key = Locator::Key(vec!["id".into()]);
        assert_eq!(
            update(&t, &["id", "v"], &key),
            "UPDATE \"public\".\"acc\" SET \"id\" = $1, \"v\" = $2 WHERE \"id\" = $3"
        );
        assert_eq!(
            delete(&t, &key),
            "DELETE FROM \"public\".\"acc\" WHERE \"id\" = $1"
        );
        let full = Locator::AllColumns(vec!["a".into(), "b".into()]);
        assert_eq!(
            delete(&t, &full),
            "DELETE FROM \"public\".\"acc\" WHERE ctid = (SELECT ctid FROM \"public\".\"acc\" WHERE \"a\" IS NOT DISTINCT FROM $1 AND \"b\" IS NOT DISTINCT FROM $2 LIMIT 1 FOR UPDATE)"
        );
    }

    #[test]
    fn fast_path_statements_fold_the_conflict_checks_in() {
        let t = qualified("public", "acc");
        let ins = fast_insert(
            &t,
            &["id", "v"],
            &["integer", "text"],
            2,
            42,
            Some(&["id"]),
            Commit::Later,
        );
        assert_eq!(
            ins,
            "WITH i AS (INSERT INTO \"public\".\"acc\" (\"id\", \"v\") OVERRIDING SYSTEM VALUE VALUES ($1::integer, $2::text), ($3::integer, $4::text) \
             RETURNING \"id\") \
             SELECT CASE WHEN (SELECT count(*) FROM i) < 0 THEN NULL \
             ELSE mm.insert_recheck(42, CASE WHEN mm.has_tombstones(42) THEN ARRAY(SELECT pg_catalog.jsonb_build_object('id', i.\"id\") FROM i) END, $5::timestamptz, $6::oid[]) END"
        );
        // Without a key there is nothing to tombstone: the truncate check only.
        assert_eq!(
            fast_insert(&t, &["a"], &["text"], 1, 42, None, Commit::Later),
            "WITH i AS (INSERT INTO \"public\".\"acc\" (\"a\") OVERRIDING SYSTEM VALUE VALUES ($1::text) RETURNING 1) \
             SELECT CASE WHEN NOT EXISTS (SELECT FROM i) THEN NULL ELSE mm.insert_recheck(42, NULL::jsonb[], $2::timestamptz, $3::oid[]) END"
        );
        let key = Locator::Key(vec!["id".into()]);
        assert_eq!(
            fast_update(&t, &["v"], &key, 1, Commit::Later),
            "WITH u AS (UPDATE \"public\".\"acc\" SET \"v\" = $1 WHERE \"id\" = $2 AND CASE WHEN mm.routine(xmin, $3::oid[], $4::timestamptz, $5::oid[], $6::timestamptz[]) THEN true ELSE mm.conflict() END RETURNING 1) SELECT count(*)::mm.one_row FROM u"
        );
        // Tombstones upserted (a key may have one), or, where no key has
        // one, a plain INSERT of them.
        for (how, clause) in [
            (TombstoneWrite::Upsert, TOMBSTONE_UPSERT),
            (TombstoneWrite::Insert, ""),
        ] {
            assert_eq!(
                fast_delete(&t, &key, 1, 42, Some(&["id"]), Commit::Later, how),
                format!(
                    "WITH d AS (DELETE FROM \"public\".\"acc\" WHERE \"id\" = $1 AND CASE WHEN mm.routine(xmin, $2::oid[], $3::timestamptz, $4::oid[], $5::timestamptz[]) THEN true ELSE mm.conflict() END RETURNING \"id\"), \
                     tb AS (INSERT INTO mm.tombstones (relid, key) SELECT 42, pg_catalog.jsonb_build_object('id', d.\"id\") FROM d{clause}) \
                     SELECT count(*)::mm.one_row FROM d"
                )
            );
        }
        // From a sole peer, no tombstone: the delete alone.
        assert_eq!(
            fast_delete(
                &t,
                &key,
                1,
                42,
                Some(&["id"]),
                Commit::Later,
                TombstoneWrite::Skip
            ),
            "WITH d AS (DELETE FROM \"public\".\"acc\" WHERE \"id\" = $1 AND CASE WHEN mm.routine(xmin, $2::oid[], $3::timestamptz, $4::oid[], $5::timestamptz[]) THEN true ELSE mm.conflict() END RETURNING \"id\") \
             SELECT count(*)::mm.one_row FROM d"
        );
        let fused_update =
            |lane| fast_update(&t, &["v"], &key, 1, Commit::Fused { first: 7, lane });
        // A transaction's only change also records its progress, and still
        // fails unless it changed exactly one row.
        assert_eq!(
            fused_update(false),
            "WITH u AS (UPDATE \"public\".\"acc\" SET \"v\" = $1 WHERE \"id\" = $2 AND CASE WHEN mm.routine(xmin, $3::oid[], $4::timestamptz, $5::oid[], $6::timestamptz[]) THEN true ELSE mm.conflict() END RETURNING 1), \
             mm_p AS (UPDATE mm.apply_progress SET remote_lsn = $9::pg_lsn, remote_commit_ts = $10::timestamptz, applied_txns = applied_txns + 1 WHERE origin = $7::text AND remote_lsn = $8::pg_lsn RETURNING 1) SELECT COALESCE((SELECT 1::bigint FROM u), 0)::mm.one_row, COALESCE((SELECT 1::bigint FROM mm_p), 0)::mm.progress_one, pg_catalog.pg_replication_origin_xact_setup('0/0', $10::timestamptz)"
        );
        assert_eq!(
            fast_delete(
                &t,
                &Locator::AllColumns(vec!["a".into()]),
                1,
                42,
                None,
                Commit::Fused {
                    first: 6,
                    lane: false
                },
                TombstoneWrite::Insert
            ),
            "WITH d AS (DELETE FROM \"public\".\"acc\" WHERE ctid = (SELECT ctid FROM \"public\".\"acc\" WHERE \"a\" IS NOT DISTINCT FROM $1 LIMIT 1 FOR UPDATE) \
             AND CASE WHEN mm.routine(xmin, $2::oid[], $3::timestamptz, $4::oid[], $5::timestamptz[]) THEN true ELSE mm.conflict() END RETURNING 1), \
             mm_p AS (UPDATE mm.apply_progress SET remote_lsn = $8::pg_lsn, remote_commit_ts = $9::timestamptz, applied_txns = applied_txns + 1 WHERE origin = $6::text AND remote_lsn = $7::pg_lsn RETURNING 1) SELECT (SELECT count(*) FROM d)::mm.one_row, COALESCE((SELECT 1::bigint FROM mm_p), 0)::mm.progress_one, pg_catalog.pg_replication_origin_xact_setup('0/0', $9::timestamptz)"
        );
        assert_eq!(
            fast_insert(
                &t,
                &["a"],
                &["text"],
                1,
                42,
                None,
                Commit::Fused {
                    first: 4,
                    lane: false
                }
            ),
            "WITH i AS (INSERT INTO \"public\".\"acc\" (\"a\") OVERRIDING SYSTEM VALUE VALUES ($1::text) RETURNING 1), \
             mm_p AS (UPDATE mm.apply_progress SET remote_lsn = $6::pg_lsn, remote_commit_ts = $7::timestamptz, applied_txns = applied_txns + 1 WHERE origin = $4::text AND remote_lsn = $5::pg_lsn RETURNING 1) \
             SELECT CASE WHEN NOT EXISTS (SELECT FROM i) THEN NULL ELSE mm.insert_recheck(42, NULL::jsonb[], $2::timestamptz, $3::oid[]) END, \
             COALESCE((SELECT 1::bigint FROM mm_p), 0)::mm.progress_one, pg_catalog.pg_replication_origin_xact_setup('0/0', $7::timestamptz)"
        );
        // One row, fused: the re-check runs before the progress record.
        assert_eq!(
            fast_insert(
                &t,
                &["id"],
                &["integer"],
                1,
                42,
                Some(&["id"]),
                Commit::Fused {
                    first: 4,
                    lane: false
                }
            ),
            "WITH i AS (INSERT INTO \"public\".\"acc\" (\"id\") OVERRIDING SYSTEM VALUE VALUES ($1::integer) RETURNING \"id\"), \
             mm_p AS (UPDATE mm.apply_progress SET remote_lsn = $6::pg_lsn, remote_commit_ts = $7::timestamptz, applied_txns = applied_txns + 1 WHERE origin = $4::text AND remote_lsn = $5::pg_lsn RETURNING 1) \
             SELECT mm.insert_recheck_key(42, (SELECT pg_catalog.jsonb_build_object('id', i.\"id\") FROM i), $2::timestamptz, $3::oid[]), \
             COALESCE((SELECT 1::bigint FROM mm_p), 0)::mm.progress_one, pg_catalog.pg_replication_origin_xact_setup('0/0', $7::timestamptz)"
        );
        // In a lane: the turn around the first column, the wait for the
        // one before after it, and the guard on the newest progress.
        assert_eq!(
            fused_update(true),
            "WITH u AS (UPDATE \"public\".\"acc\" SET \"v\" = $1 WHERE \"id\" = $2 AND CASE WHEN mm.routine(xmin, $3::oid[], $4::timestamptz, $5::oid[], $6::timestamptz[]) THEN true ELSE mm.conflict() END RETURNING 1), \
             mm_p AS (UPDATE mm.apply_progress SET remote_lsn = $9::pg_lsn, remote_commit_ts = $10::timestamptz, applied_txns = applied_txns + 1 WHERE origin = $7::text RETURNING OLD.remote_lsn = $8::pg_lsn AS mm_ok) \
             SELECT CASE WHEN pg_catalog.set_config('lock_timeout', '5s', true) IS NULL THEN NULL \
             WHEN pg_catalog.pg_advisory_xact_lock($11::int4, $12::int4) IS NULL THEN NULL \
             WHEN pg_catalog.pg_advisory_lock($13::int4, $14::int4) IS NULL THEN NULL \
             WHEN pg_catalog.pg_advisory_unlock($13::int4, $15::int4) IS NULL THEN NULL \
             ELSE COALESCE((SELECT 1::bigint FROM u), 0)::mm.one_row END, \
             pg_catalog.pg_advisory_xact_lock_shared($13::int4, $16::int4), \
             pg_catalog.pg_advisory_xact_lock_shared($11::int4, $17::int4), \
             COALESCE((SELECT 1::bigint FROM mm_p WHERE mm_p.mm_ok), 0)::mm.progress_one, pg_catalog.pg_replication_origin_xact_setup('0/0', $10::timestamptz)"
        );
        // A group's rows of one table in one statement: each its own
        // commit timestamp, the user's names only on the target's alias.
        assert_eq!(
            fast_update_many(
                &t,
                &["mm_1", "v"],
                &["integer", "text"],
                &["mm_1"],
                &["integer"],
                2
            ),
            "WITH mm_v (mm_1, mm_2, mm_3, mm_ts) AS (VALUES ($1::integer, $2::text, $3::integer, $4::timestamptz), \
             ($5::integer, $6::text, $7::integer, $8::timestamptz)), \
             u AS (UPDATE \"public\".\"acc\" AS mm_t SET \"mm_1\" = mm_v.mm_1, \"v\" = mm_v.mm_2 FROM mm_v \
             WHERE mm_t.\"mm_1\" = mm_v.mm_3 AND mm_t.\"mm_1\" = ANY (ARRAY(SELECT mm_b.mm_3 FROM mm_v AS mm_b)) AND CASE WHEN mm.routine(mm_t.xmin, $9::oid[], mm_v.mm_ts, $10::oid[], $11::timestamptz[]) \
             THEN true ELSE mm.conflict() END RETURNING 1) \
             SELECT (CASE WHEN (SELECT count(*) FROM u) = 2 THEN 1 ELSE 0 END)::mm.one_row"
        );
        assert_eq!(
            fast_delete_many(
                &t,
                &["a", "b"],
                &["integer", "text"],
                42,
                2,
                TombstoneWrite::Upsert
            ),
            "WITH mm_v (mm_1, mm_2, mm_ts) AS (VALUES ($1::integer, $2::text, $3::timestamptz), ($4::integer, $5::text, $6::timestamptz)), \
             d AS (DELETE FROM \"public\".\"acc\" AS mm_t USING mm_v WHERE mm_t.\"a\" = mm_v.mm_1 AND mm_t.\"a\" = ANY (ARRAY(SELECT mm_b.mm_1 FROM mm_v AS mm_b)) \
             AND mm_t.\"b\" = mm_v.mm_2 AND mm_t.\"b\" = ANY (ARRAY(SELECT mm_b.mm_2 FROM mm_v AS mm_b)) \
             AND CASE WHEN mm.routine(mm_t.xmin, $7::oid[], mm_v.mm_ts, $8::oid[], $9::timestamptz[]) THEN true ELSE mm.conflict() END \
             RETURNING mm_t.\"a\", mm_t.\"b\"), \
             tb AS (INSERT INTO mm.tombstones (relid, key) SELECT 42, pg_catalog.jsonb_build_object('a', d.\"a\", 'b', d.\"b\") FROM d \
             ON CONFLICT (relid, pg_catalog.jsonb_hash_extended(key, 0), key) DO UPDATE SET relid = EXCLUDED.relid) \
             SELECT (CASE WHEN (SELECT count(*) FROM d) = 2 THEN 1 ELSE 0 END)::mm.one_row"
        );
        // A quote in a key column name stays inside the literal.
        assert_eq!(
            key_json(&["it's"], |_, _| "$1".into()),
            "pg_catalog.jsonb_build_object('it''s', $1)"
        );
    }

    #[test]
    fn batch_procedures_quote_their_body_with_a_tag_it_lacks() {
        let t = qualified("public", "acc");
        let cols = ["$mm_batch0$", "v"];
        let def = batch_procedure(&[BatchStep {
            table: &t,
            relid: 42,
            change: BatchChange::Insert {
                cols: &cols,
                types: &["text", "integer"],
                key_cols: &["$mm_batch0$"],
            },
        }]);
        assert!(
            def.contains(" LANGUAGE plpgsql AS $mm_batch1$\n#variable_conflict use_variable\n")
        );
        assert!(def.ends_with("END\n$mm_batch1$"));
        assert_eq!(def.matches("$mm_batch1$").count(), 2);
        // The user's column only quoted: in the column list and qualified.
        assert!(def.contains("(\"$mm_batch0$\", \"v\") OVERRIDING SYSTEM VALUE VALUES (mm_c1[mm_i]::text, mm_c2[mm_i]::integer)"));
        assert!(def.contains(
            "pg_catalog.jsonb_build_object('$mm_batch0$', mm_t.\"$mm_batch0$\") INTO mm_key0"
        ));
    }

    #[test]
    fn an_inserts_recheck_rides_on_the_progress_record_unless_a_delete_follows() {
        let (t, h) = (qualified("public", "acc"), qualified("public", "hist"));
        let insert = |table| BatchStep {
            table,
            relid: 7,
            change: BatchChange::Insert {
                cols: &["id"],
                types: &["bigint"],
                key_cols: &["id"],
            },
        };
        let delete = BatchStep {
            table: &h,
            relid: 8,
            change: BatchChange::Delete {
                key_cols: &["id"],
                key_types: &["bigint"],
                tombstones: TombstoneWrite::Insert,
            },
        };
        let progress =
            |def: &str| def[def.find("UPDATE mm.apply_progress").unwrap_or(0)..].to_owned();
        // Alone: checked by the progress record, after the insert.
        let def = batch_procedure(&[insert(&t)]);
        assert!(!def.contains("mm.insert_recheck_key"), "{def}");
        assert!(progress(&def).contains(
            "remote_lsn = mm_prev AND CASE WHEN EXISTS (SELECT FROM mm.truncates tr WHERE tr.relid = 7 "
        ));
        assert!(progress(&def).contains("pg_catalog.jsonb_hash_extended(mm_key0, 0) AND tb.key = mm_key0) THEN mm.conflict() ELSE true END;"));
        assert!(def.contains("DECLARE\n  mm_i int;\n  mm_key0 jsonb;\nBEGIN"));
        // Before a delete of the same transaction: at once, before the
        // delete's tombstone exists; after one: on the progress record.
        let def = batch_procedure(&[insert(&t), delete.clone(), insert(&h)]);
        let (first, del) = (
            def.find("PERFORM mm.insert_recheck_key(7, mm_key0, mm_ts[mm_i], mm_origins);")
                .unwrap_or(usize::MAX),
            def.find("WITH d AS (DELETE").unwrap_or(0),
        );
        assert!(first < del, "{def}");
        assert!(!progress(&def).contains("mm_key0"));
        assert!(progress(&def).contains("tb.key = mm_key2)"));
        assert!(def.contains("mm_key0 jsonb;\n  mm_key2 jsonb;\nBEGIN"));
    }

    #[test]
    fn a_batch_of_two_changes_per_transaction_numbers_its_arrays_on() {
        let (t, h) = (qualified("public", "acc"), qualified("public", "hist"));
        let steps = [
            BatchStep {
                table: &t,
                relid: 7,
                change: BatchChange::Update {
                    set_cols: &["id", "n"],
                    set_types: &["bigint", "bigint"],
                    key_cols: &["id"],
                    key_types: &["bigint"],
                },
            },
            BatchStep {
                table: &h,
                relid: 8,
                change: BatchChange::Insert {
                    cols: &["id", "v"],
                    types: &["bigint", "text"],
                    key_cols: &["id"],
                },
            },
        ];
        let def = batch_procedure(&steps);
        assert!(def.contains(", mm_c5 text[])"));
        assert!(!def.contains("mm_c6"));
        assert!(def.contains(
            "SET \"id\" = mm_c1[mm_i]::bigint, \"n\" = mm_c2[mm_i]::bigint WHERE mm_t.\"id\" = mm_c3[mm_i]::bigint AND"
        ));
        assert!(def.contains("VALUES (mm_c4[mm_i]::bigint, mm_c5[mm_i]::text)"));
        // The update's checks come before the insert, both before the
        // transaction's progress record and COMMIT.
        let (u, i, p) = (
            def.find("UPDATE \"public\".\"acc\"").unwrap_or(usize::MAX),
            def.find("INSERT INTO \"public\".\"hist\"").unwrap_or(0),
            def.find("UPDATE mm.apply_progress").unwrap_or(0),
        );
        assert!(u < i && i < p, "{def}");
    }

    #[test]
    fn a_batch_update_sets_its_columns_and_finds_the_row_by_the_arrays_after_them() {
        let t = qualified("public", "acc");
        let change = BatchChange::Update {
            set_cols: &["mm_i", "mm_c1"],
            set_types: &["integer", "text"],
            key_cols: &["mm_i"],
            key_types: &["integer"],
        };
        assert_eq!(change.arrays(), 3);
        let def = batch_procedure(&[BatchStep {
            table: &t,
            relid: 7,
            change: change.clone(),
        }]);
        assert!(def.starts_with(
            "(mm_o text, mm_prev pg_lsn, mm_origins oid[], mm_wm_ids oid[], mm_wm_ts timestamptz[], \
             mm_end pg_lsn[], mm_ts timestamptz[], mm_c1 text[], mm_c2 text[], mm_c3 text[])"
        ));
        assert!(def.contains(
            "UPDATE \"public\".\"acc\" AS mm_t SET \"mm_i\" = mm_c1[mm_i]::integer, \"mm_c1\" = mm_c2[mm_i]::text \
             WHERE mm_t.\"mm_i\" = mm_c3[mm_i]::integer AND CASE WHEN mm.routine(mm_t.xmin, mm_origins, mm_ts[mm_i], mm_wm_ids, mm_wm_ts)"
        ));
        assert_eq!(
            batch_call("pg_temp.mm_batch_3", change.arrays()),
            "CALL pg_temp.mm_batch_3($1::text, $2::pg_lsn, $3::oid[], $4::oid[], $5::timestamptz[], \
             $6::pg_lsn[], $7::timestamptz[], $8::text[], $9::text[], $10::text[])"
        );
    }
}
