-- Functions and triggers of schema mm. Not a migration: CREATE OR REPLACE,
-- run at every agent start, so a new agent version brings its own.

-- Transaction progress is recorded by the guard the agent inlines into its
-- apply statements (apply/sql.rs, progress_cte, and the domain
-- mm.progress_one); the plpgsql function that did it cost an executor and
-- SPI setup per applied transaction. Dropped where an older agent left it.
DROP FUNCTION IF EXISTS mm.advance_progress(text, pg_lsn, pg_lsn, timestamptz);

-- The index the applier locates rows by: replica identity index, else
-- primary key. pg_index is small enough that the planner scans all of it,
-- deforming every row (with its int2vector and oidvector columns) on each
-- call: a third of a million instructions; its indexes make it a few probes.
CREATE OR REPLACE FUNCTION mm.key_index(p_rel oid) RETURNS oid
LANGUAGE sql STABLE SET search_path = pg_catalog SET enable_seqscan = off AS $fn$
  SELECT i.indexrelid FROM pg_index i
   WHERE i.indrelid = p_rel AND (i.indisreplident OR i.indisprimary) AND i.indisvalid
   ORDER BY i.indisreplident DESC LIMIT 1
$fn$;

-- An index's columns, in the index's order; NULL for no index.
CREATE OR REPLACE FUNCTION mm.index_columns(p_index oid) RETURNS text[]
LANGUAGE sql STABLE SET search_path = pg_catalog SET enable_seqscan = off AS $fn$
  SELECT ARRAY(SELECT a.attname::text FROM pg_attribute a
                WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
                ORDER BY array_position(i.indkey::int2[], a.attnum))
    FROM pg_index i
   WHERE i.indexrelid = p_index
$fn$;

-- The key index's columns; NULL without one.
CREATE OR REPLACE FUNCTION mm.key_columns(p_rel oid) RETURNS text[]
LANGUAGE sql STABLE SET search_path = pg_catalog AS $fn$
  SELECT mm.index_columns(mm.key_index(p_rel))
$fn$;

-- The key columns a tombstone trigger records. mm.install_tombstone_trigger
-- passes the key index's oid and its columns as the trigger's arguments, so
-- a local DELETE does not query the catalog (mm.key_columns cost more than
-- the DELETE itself). pg_get_replica_identity_index reads the relcache, and
-- an index's columns never change, but their names do (RENAME COLUMN keeps
-- the index): the arguments hold while the index they name is the table's
-- key and its column still has the name they give (pg_get_indexdef of one
-- column reads the syscache). Otherwise (REPLICA IDENTITY FULL or NOTHING,
-- a key changed or renamed since the trigger was made, a trigger from an
-- older agent) the catalog answers, as it does for keys of several columns
-- (checking every name would take a subquery). Plain SQL, so the planner
-- inlines it.
CREATE OR REPLACE FUNCTION mm.trigger_key_columns(p_rel oid, p_index text, p_cols text[]) RETURNS text[]
LANGUAGE sql STABLE AS $fn$
  SELECT CASE WHEN pg_catalog.cardinality(p_cols) OPERATOR(pg_catalog.=) 1
                   AND pg_catalog.pg_get_replica_identity_index(p_rel::pg_catalog.regclass)::pg_catalog.oid
                       OPERATOR(pg_catalog.=) p_index::pg_catalog.oid
                   AND pg_catalog.pg_get_indexdef(p_index::pg_catalog.oid, 1, false)
                       OPERATOR(pg_catalog.=) pg_catalog.quote_ident(p_cols[1])
              THEN p_cols ELSE mm.key_columns(p_rel) END
$fn$;

-- Local deletes leave tombstones: a statement trigger (one run per DELETE
-- statement, not per row) over the transition table. It does not fire in the
-- agent's apply sessions (session_replication_role = replica): remote deletes
-- write their tombstones themselves.
--
-- The tombstone is an upsert, although a plain INSERT would write one WAL
-- record fewer per DELETE (the publisher's walsender pays a system call
-- per record it reads: ARCHITECTURE.md, "Apply throughput"). A key whose
-- tombstone exists, or is being written by an apply session (a remote
-- delete of a row this transaction inserted and now deletes), would fail
-- the user's DELETE with a unique violation, where the upsert waits and
-- raises the tombstone's version. Catching that in a plpgsql EXCEPTION
-- block would give every DELETE statement a subtransaction.
CREATE OR REPLACE FUNCTION mm.record_local_deletes() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog SET TimeZone = 'UTC' SET DateStyle = 'ISO'
SET IntervalStyle = 'postgres' SET extra_float_digits = 3 AS $fn$
#variable_conflict use_variable
DECLARE
  cols text[] := mm.trigger_key_columns(TG_RELID, TG_ARGV[0], TG_ARGV[1:]);
BEGIN
  IF cols IS NULL THEN
    RETURN NULL;
  END IF;
  -- A single-column key (most tables) is taken straight from the row: a
  -- statement of its own, since a subquery costs its setup even where a
  -- CASE does not evaluate it.
  IF cardinality(cols) = 1 THEN
    INSERT INTO mm.tombstones (relid, key)
    SELECT DISTINCT TG_RELID, jsonb_build_object(cols[1], to_jsonb(o.*) -> cols[1])
      FROM mm_old o
    ON CONFLICT (relid, pg_catalog.jsonb_hash_extended(key, 0), key) DO UPDATE SET relid = EXCLUDED.relid;
  ELSE
    INSERT INTO mm.tombstones (relid, key)
    SELECT DISTINCT TG_RELID,
           (SELECT jsonb_object_agg(e.key, e.value) FROM jsonb_each(to_jsonb(o.*)) e WHERE e.key = ANY (cols))
      FROM mm_old o
    ON CONFLICT (relid, pg_catalog.jsonb_hash_extended(key, 0), key) DO UPDATE SET relid = EXCLUDED.relid;
  END IF;
  RETURN NULL;
END
$fn$;

-- Local truncates record the table's truncate version (mm.truncates); like
-- the delete trigger, it does not fire in apply sessions.
CREATE OR REPLACE FUNCTION mm.record_local_truncate() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
BEGIN
  INSERT INTO mm.truncates (relid) VALUES (TG_RELID)
  ON CONFLICT (relid) DO UPDATE SET relid = EXCLUDED.relid;
  RETURN NULL;
END
$fn$;

-- Partitioned tables: a row trigger on the root, which PostgreSQL clones to
-- every partition (present and future), so deletes through the root and
-- straight on a partition both leave their tombstone, keyed by the ROOT
-- (the identity changes arrive under: publish_via_partition_root).
-- Statement triggers with transition tables cannot cover partitions.
-- Also the key-change trigger's function on every table (OLD is the row
-- whose key went away).
CREATE OR REPLACE FUNCTION mm.record_local_delete_row() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog SET TimeZone = 'UTC' SET DateStyle = 'ISO'
SET IntervalStyle = 'postgres' SET extra_float_digits = 3 AS $fn$
#variable_conflict use_variable
DECLARE
  root oid := coalesce(pg_partition_root(TG_RELID), TG_RELID);
  -- A partition's row asks the catalog: pg_get_replica_identity_index
  -- opens the table it is given, and a DELETE aimed at a partition must not
  -- lock the root (a TRUNCATE or ALTER of the root holds it while it waits
  -- for the partition: a deadlock).
  cols text[] := CASE WHEN root = TG_RELID THEN mm.trigger_key_columns(root, TG_ARGV[0], TG_ARGV[1:])
                      ELSE mm.key_columns(root) END;
  old_key jsonb;
BEGIN
  IF cols IS NULL THEN
    RETURN NULL;
  END IF;
  IF cardinality(cols) = 1 THEN
    old_key := jsonb_build_object(cols[1], to_jsonb(OLD.*) -> cols[1]);
  ELSE
    old_key := (SELECT jsonb_object_agg(e.key, e.value) FROM jsonb_each(to_jsonb(OLD.*)) e WHERE e.key = ANY (cols));
  END IF;
  -- An UPDATE fires this only when a column of the key it was made for
  -- changed; if the key has changed since (the trigger is made again at
  -- the next start), the row may still have its key: no tombstone then.
  IF TG_OP = 'UPDATE' AND old_key = (CASE WHEN cardinality(cols) = 1
                                          THEN jsonb_build_object(cols[1], to_jsonb(NEW.*) -> cols[1])
                                          ELSE (SELECT jsonb_object_agg(e.key, e.value) FROM jsonb_each(to_jsonb(NEW.*)) e
                                                 WHERE e.key = ANY (cols)) END) THEN
    RETURN NULL;
  END IF;
  INSERT INTO mm.tombstones (relid, key) VALUES (root, old_key)
  ON CONFLICT (relid, pg_catalog.jsonb_hash_extended(key, 0), key) DO UPDATE SET relid = EXCLUDED.relid;
  RETURN NULL;
END
$fn$;

-- Makes one of a table's agent triggers, or makes it again when it exists
-- with other arguments (made for another key, or by an older agent). A new
-- trigger waits for its table's lock as long as it takes: without it local
-- deletes leave no tombstone. Making one again waits at most a second: the
-- lock (SHARE ROW EXCLUSIVE) would queue every write to the table behind
-- the longest transaction open on it. Meanwhile the delete trigger stays
-- correct (mm.trigger_key_columns falls back to the catalog); a key-change
-- trigger made for other columns misses updates of the new key's columns
-- until a start can make it again, as after any ALTER that changes a key
-- (DDL is not followed between starts). False when it was left as it was.
CREATE OR REPLACE FUNCTION mm.make_trigger(p_rel oid, p_name text, p_ddl text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
#variable_conflict use_variable
DECLARE
  waited text := current_setting('lock_timeout');
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = p_rel AND tgname = p_name) THEN
    EXECUTE p_ddl;
    RETURN true;
  END IF;
  BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    EXECUTE p_ddl;
    PERFORM set_config('lock_timeout', waited, true);
    RETURN true;
  EXCEPTION WHEN lock_not_available THEN
    RETURN false;
  END;
END
$fn$;

-- The agent's triggers on one table, current for its key; false when one
-- made for another key is left in place (mm.make_trigger). It returned
-- nothing before this agent version: dropped, as a return type cannot be
-- replaced.
DROP FUNCTION IF EXISTS mm.install_tombstone_trigger(oid);
CREATE OR REPLACE FUNCTION mm.install_tombstone_trigger(p_rel oid) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
#variable_conflict use_variable
DECLARE
  parted boolean := (SELECT relkind = 'p' FROM pg_class WHERE oid = p_rel);
  idx oid := mm.key_index(p_rel);
  -- The index's own columns, not mm.key_columns: the key could change
  -- between two lookups, and the arguments must describe one index.
  cols text[] := mm.index_columns(idx);
  -- The arguments mm.trigger_key_columns reads: the key index, its columns.
  args text[] := CASE WHEN cols IS NULL THEN '{}'::text[] ELSE idx::text || cols END;
  arglist text := (SELECT string_agg(quote_literal(a), ', ' ORDER BY o)
                     FROM unnest(args) WITH ORDINALITY u(a, o));
  -- The same as pg_trigger stores them, to tell a trigger made for another
  -- key (or by an older agent) from a current one: only those are made
  -- again, so an agent's start takes no lock on a table whose triggers
  -- are current.
  stored bytea := coalesce((SELECT string_agg(convert_to(a, getdatabaseencoding()) || decode('00', 'hex'), ''::bytea ORDER BY o)
                              FROM unnest(args) WITH ORDINALITY u(a, o)), ''::bytea);
  current boolean := true;
BEGIN
  IF parted IS NULL THEN
    RETURN true;  -- dropped since it was listed
  END IF;
  -- An older agent put a statement trigger on partitioned roots too.
  IF parted AND EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = p_rel AND tgname = 'mm_tombstones'
                                                   AND tgtype & 1 = 0) THEN
    EXECUTE format('DROP TRIGGER mm_tombstones ON %s', p_rel::regclass);
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = p_rel AND tgname = 'mm_tombstones'
                                            AND tgargs = stored) THEN
    IF parted THEN
      current := mm.make_trigger(p_rel, 'mm_tombstones',
        format('CREATE OR REPLACE TRIGGER mm_tombstones AFTER DELETE ON %s '
               'FOR EACH ROW EXECUTE FUNCTION mm.record_local_delete_row(%s)', p_rel::regclass, arglist));
    ELSE
      current := mm.make_trigger(p_rel, 'mm_tombstones',
        format('CREATE OR REPLACE TRIGGER mm_tombstones AFTER DELETE ON %s REFERENCING OLD TABLE AS mm_old '
               'FOR EACH STATEMENT EXECUTE FUNCTION mm.record_local_deletes(%s)', p_rel::regclass, arglist));
    END IF;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = p_rel AND tgname = 'mm_truncates') THEN
    EXECUTE format('CREATE TRIGGER mm_truncates AFTER TRUNCATE ON %s '
                   'FOR EACH STATEMENT EXECUTE FUNCTION mm.record_local_truncate()', p_rel::regclass);
  END IF;
  -- A local update that changes a row's key deletes the old key: its
  -- tombstone, or an older change to the old key arriving later would
  -- bring it back here and not on the nodes that applied the move (apply
  -- sessions write their own). The WHEN clause is evaluated without a
  -- function call, so updates that keep the key cost nothing. Rows moving
  -- between partitions fire the delete trigger instead. Made again when
  -- the key changed: its column list is the key's.
  IF current AND cols IS NOT NULL
     AND NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = p_rel AND tgname = 'mm_key_changes'
                                              AND tgargs = stored) THEN
    current := mm.make_trigger(p_rel, 'mm_key_changes',
      format('CREATE OR REPLACE TRIGGER mm_key_changes AFTER UPDATE OF %s ON %s FOR EACH ROW WHEN (%s) '
             'EXECUTE FUNCTION mm.record_local_delete_row(%s)',
             (SELECT string_agg(quote_ident(k), ', ') FROM unnest(cols) k),
             p_rel::regclass,
             (SELECT string_agg(format('OLD.%I IS DISTINCT FROM NEW.%I', k, k), ' OR ') FROM unnest(cols) k),
             arglist));
  END IF;
  RETURN current;
END
$fn$;

-- Publishing via the partition root, PostgreSQL does not replicate a
-- TRUNCATE of a single partition. This trigger on every partition sends it
-- as a transactional logical message `mm.truncate` instead (in the
-- truncating transaction, so in its commit order); peers apply it with
-- mm.apply_partition_truncate. A TRUNCATE of the root also fires it on each
-- partition: applying those again after the root's is a no-op.
CREATE OR REPLACE FUNCTION mm.record_partition_truncate() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
BEGIN
  INSERT INTO mm.truncates (relid) VALUES (TG_RELID)
  ON CONFLICT (relid) DO UPDATE SET relid = EXCLUDED.relid;
  PERFORM pg_logical_emit_message(true, 'mm.truncate',
    jsonb_build_object('schema', TG_TABLE_SCHEMA, 'table', TG_TABLE_NAME)::text);
  RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION mm.install_partition_trigger(p_rel oid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = p_rel AND tgname = 'mm_truncates') THEN
    EXECUTE format('CREATE TRIGGER mm_truncates AFTER TRUNCATE ON %s '
                   'FOR EACH STATEMENT EXECUTE FUNCTION mm.record_partition_truncate()', p_rel::regclass);
  END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION mm.apply_partition_truncate(p_msg jsonb, p_ts timestamptz)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
#variable_conflict use_variable
DECLARE
  rel oid := to_regclass(format('%I.%I', p_msg->>'schema', p_msg->>'table'));
BEGIN
  IF rel IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = '42P01',
      MESSAGE = format('partition %I.%I, truncated on the publisher, does not exist on this node',
                       p_msg->>'schema', p_msg->>'table');
  END IF;
  PERFORM mm.apply_truncate(ARRAY[rel], p_ts, false, false);
END
$fn$;

-- A remote TRUNCATE (commit timestamp p_ts) of the tables p_rels: it wins
-- over every older row and loses to newer ones, on every node. Records the
-- tables' truncate versions (never replacing a newer one); then, when no
-- row of them is newer than the truncate, TRUNCATEs them as the publisher
-- did; otherwise deletes just the older rows (no tombstones needed: the
-- truncate version covers every key). Rows written by this same remote
-- transaction (no commit timestamp yet) count as older: they came before
-- the TRUNCATE in it.
CREATE OR REPLACE FUNCTION mm.apply_truncate(
    p_rels oid[], p_ts timestamptz, p_cascade boolean, p_restart boolean)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
#variable_conflict use_variable
DECLARE
  r oid;
  newer boolean := false;
  found_newer boolean;
BEGIN
  FOREACH r IN ARRAY p_rels LOOP
    INSERT INTO mm.truncates AS t (relid) VALUES (r)
    ON CONFLICT (relid) DO UPDATE SET relid = EXCLUDED.relid
     WHERE coalesce(pg_xact_commit_timestamp(t.xmin), '-infinity') <= p_ts;
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE pg_catalog.pg_xact_commit_timestamp(xmin) > $1)',
                   r::regclass) INTO found_newer USING p_ts;
    newer := newer OR found_newer;
  END LOOP;
  IF NOT newer THEN
    EXECUTE format('TRUNCATE %s%s%s',
                   (SELECT string_agg(x::regclass::text, ', ') FROM unnest(p_rels) x),
                   CASE WHEN p_restart THEN ' RESTART IDENTITY' ELSE '' END,
                   CASE WHEN p_cascade THEN ' CASCADE' ELSE '' END);
    RETURN;
  END IF;
  FOREACH r IN ARRAY p_rels LOOP
    EXECUTE format('DELETE FROM %s WHERE coalesce(pg_catalog.pg_xact_commit_timestamp(xmin), ''-infinity'') <= $1',
                   r::regclass) USING p_ts;
  END LOOP;
END
$fn$;

CREATE OR REPLACE FUNCTION mm.on_create_table() RETURNS event_trigger
LANGUAGE plpgsql SET search_path = pg_catalog AS $fn$
DECLARE
  r record;
BEGIN
  FOR r IN SELECT c.oid FROM pg_event_trigger_ddl_commands() d
             JOIN pg_class c ON c.oid = d.objid
             JOIN pg_publication_namespace pn ON pn.pnnspid = c.relnamespace
             JOIN pg_publication p ON p.oid = pn.pnpubid AND p.pubname = 'mm'
            WHERE d.object_type = 'table' AND c.relkind IN ('r', 'p') AND NOT c.relispartition
  LOOP
    PERFORM mm.install_tombstone_trigger(r.oid);
  END LOOP;
  FOR r IN SELECT c.oid FROM pg_event_trigger_ddl_commands() d
             JOIN pg_class c ON c.oid = d.objid
             JOIN pg_publication_namespace pn ON pn.pnnspid = c.relnamespace
             JOIN pg_publication p ON p.oid = pn.pnpubid AND p.pubname = 'mm'
            WHERE d.object_type = 'table' AND c.relkind IN ('r', 'p') AND c.relispartition
  LOOP
    PERFORM mm.install_partition_trigger(r.oid);
  END LOOP;
END
$fn$;

DROP EVENT TRIGGER IF EXISTS mm_tombstones;
CREATE EVENT TRIGGER mm_tombstones ON ddl_command_end
  WHEN TAG IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO')
  EXECUTE FUNCTION mm.on_create_table();

-- Counts a routine cross-origin change for status, in a session setting:
-- a rolled-back transaction's changes are not counted.
CREATE OR REPLACE FUNCTION mm.count_routine() RETURNS boolean
LANGUAGE sql VOLATILE AS $fn$
  SELECT pg_catalog.set_config('mm.routine_changes',
    (coalesce(nullif(pg_catalog.current_setting('mm.routine_changes', true), ''), '0')::bigint + 1)::text,
    false) IS NOT NULL
$fn$;

-- The fast path's test, per row version it is about to change: applying
-- without the resolver is safe when the version has no known commit (written
-- by this same remote transaction, or with no history), was written by the same
-- origin (its stream is ordered), or is ROUTINE: the publisher had already
-- applied it (its watermark for that origin has reached the version's commit
-- timestamp) and the incoming change is later. Anything else goes to the
-- resolver. Plain SQL without SET clauses: this runs for every replicated
-- UPDATE and DELETE (a plpgsql version with a search_path clause cost a third
-- of the apply rate).
-- Written out in the hot-key resolving UPDATE (apply/sql.rs,
-- `fast_update_in_place`) over the commit timestamp and origin it reads
-- anyway: a change here changes it there.
-- p_origin: the publisher's origin ids, one per apply lane of its stream
-- (stream/names.rs): a version any lane wrote is the publisher's.
DROP FUNCTION IF EXISTS mm.routine(xid, oid, timestamptz, oid[], timestamptz[]);
DROP FUNCTION IF EXISTS mm.routine_full(xid, oid, timestamptz, oid[], timestamptz[]);
CREATE OR REPLACE FUNCTION mm.routine_full(
    p_xmin xid, p_origin oid[], p_ts timestamptz, p_wm_ids oid[], p_wm_ts timestamptz[])
RETURNS boolean LANGUAGE sql VOLATILE AS $fn$
  SELECT CASE
    WHEN c.timestamp IS NULL OR c.roident = ANY (p_origin) THEN true
    WHEN c.timestamp <= p_wm_ts[pg_catalog.array_position(p_wm_ids, c.roident)]
         AND c.timestamp < p_ts THEN mm.count_routine()
    ELSE false END
  FROM pg_catalog.pg_xact_commit_timestamp_origin(p_xmin) c
$fn$;

-- The common case first, in a form the planner inlines into the statement
-- (one expression, no FROM): a version from the publisher itself. Measured
-- with pgbench: the full check costs ~20% of a single-row UPDATE, this ~9%.
CREATE OR REPLACE FUNCTION mm.routine(
    p_xmin xid, p_origin oid[], p_ts timestamptz, p_wm_ids oid[], p_wm_ts timestamptz[])
RETURNS boolean LANGUAGE sql VOLATILE AS $fn$
  SELECT CASE WHEN (pg_catalog.pg_xact_commit_timestamp_origin(p_xmin)).roident = ANY (p_origin) THEN true
              ELSE mm.routine_full(p_xmin, p_origin, p_ts, p_wm_ids, p_wm_ts) END
$fn$;

-- Raised by a fast-path statement that needs the resolver: the applier
-- rolls the transaction back and applies it again with conflict detection
-- and resolution (apply/careful/). Only ever called on that path.
CREATE OR REPLACE FUNCTION mm.conflict() RETURNS boolean
LANGUAGE plpgsql AS $fn$
BEGIN
  RAISE EXCEPTION USING ERRCODE = 'MM001', MESSAGE = 'mm: conflict, resolving';
END
$fn$;

-- Called by a fast-path INSERT after all its rows went in (sql.rs,
-- `fast_insert`): raises MM001 when one of the inserted keys has a
-- tombstone now, or the table was truncated at or after the change's
-- commit timestamp. Under the statement's snapshot these checks would miss
-- a delete committing while the insert runs: it may wait at a key's index
-- entry on a transaction deleting the old row (a user's DELETE, a
-- compensating delete, another stream's applied delete), and when that one
-- commits the insert goes in; only a fresh snapshot sees the tombstone it
-- left. The truncate check moved here from the INSERT's WHERE with it.
-- VOLATILE (the default) is what gives each call that
-- snapshot in READ COMMITTED; the body has sublinks, so it is never inlined
-- into the caller's snapshot. One call per statement, not per row (per
-- row, a 100-row INSERT cost 3x); SQL, not plpgsql: measurably cheaper.
--
-- A truncate from the publisher itself (its origins, p_origin) never
-- counts: it was applied here, so it committed there before this change was
-- made (the TRUNCATE's lock keeps a change to the table either before its
-- start, and then the change's transaction commits and is sent first, or
-- after its commit), which makes the change newer on the publisher's clock
-- whatever its timestamp. That is what lets a streamed transaction, whose
-- timestamp is not known yet (`-infinity`), be applied while it arrives
-- into a table its publisher truncated before (the load-a-staging-table
-- pattern); any other truncate still stops it.
DROP FUNCTION IF EXISTS mm.insert_recheck(oid, jsonb);
DROP FUNCTION IF EXISTS mm.insert_recheck(oid, jsonb[]);
DROP FUNCTION IF EXISTS mm.insert_recheck(oid, jsonb[], timestamptz);
CREATE OR REPLACE FUNCTION mm.insert_recheck(
    p_rel oid, p_keys jsonb[], p_ts timestamptz, p_origin oid[])
RETURNS boolean LANGUAGE sql VOLATILE AS $fn$
  SELECT CASE WHEN EXISTS (SELECT FROM mm.truncates tr
                            WHERE tr.relid = p_rel
                              AND (pg_catalog.pg_xact_commit_timestamp_origin(tr.xmin))."timestamp" >= p_ts
                              AND (pg_catalog.pg_xact_commit_timestamp_origin(tr.xmin)).roident <> ALL (p_origin))
               OR (p_keys IS NOT NULL AND EXISTS (SELECT 1 FROM mm.tombstones tb
                             WHERE tb.relid = p_rel AND tb.key = ANY (p_keys)
                               AND pg_catalog.jsonb_hash_extended(tb.key, 0)
                                   = ANY (ARRAY(SELECT pg_catalog.jsonb_hash_extended(k, 0)
                                                  FROM pg_catalog.unnest(p_keys) AS k))))
              THEN mm.conflict() ELSE true END
$fn$;

-- mm.insert_recheck for a single-row INSERT whose table has a key, the
-- common OLTP insert: the same two checks, with the same fresh snapshot, in
-- the plan that is cheapest to start, since the executor is set up again
-- for every call. The key is compared by its hash and then itself (one
-- probe of mm_tombstones_key, no array to unnest), and the truncate check
-- reads the commit of the table's one truncate row in its WHERE instead of
-- joining a function scan (mm.insert_recheck now does the same). Measured
-- with callgrind on a single-row INSERT transaction as the apply session
-- sends it: 99k instructions for mm.insert_recheck as it was, 70k for this
-- (of ~270k for the whole transaction). The batch procedure writes the same
-- two checks into its progress record instead of calling this (sql.rs,
-- `batch_insert_recheck`, where it says why): change both together.
CREATE OR REPLACE FUNCTION mm.insert_recheck_key(
    p_rel oid, p_key jsonb, p_ts timestamptz, p_origin oid[])
RETURNS boolean LANGUAGE sql VOLATILE AS $fn$
  SELECT CASE WHEN EXISTS (SELECT FROM mm.truncates tr
                            WHERE tr.relid = p_rel
                              AND (pg_catalog.pg_xact_commit_timestamp_origin(tr.xmin))."timestamp" >= p_ts
                              AND (pg_catalog.pg_xact_commit_timestamp_origin(tr.xmin)).roident <> ALL (p_origin))
               OR EXISTS (SELECT FROM mm.tombstones tb
                           WHERE tb.relid = p_rel
                             AND pg_catalog.jsonb_hash_extended(tb.key, 0) = pg_catalog.jsonb_hash_extended(p_key, 0)
                             AND tb.key = p_key)
              THEN mm.conflict() ELSE true END
$fn$;

-- Whether a table has any tombstone now (fresh snapshot, as above): when
-- not, a multi-row INSERT does not build its keys for `mm.insert_recheck`.
CREATE OR REPLACE FUNCTION mm.has_tombstones(p_rel oid) RETURNS boolean
LANGUAGE sql VOLATILE AS $fn$
  SELECT EXISTS (SELECT 1 FROM mm.tombstones tb WHERE tb.relid = p_rel)
$fn$;

-- A compensating delete (mm.compensations, schema version 4), run by the
-- agent in an ordinary session after the applying transaction committed:
-- deletes the key's row if one is back, raises its tombstone to this
-- transaction's version, and sends the delete to every peer as the
-- transactional logical message `mm.delete` (the row is usually gone
-- here already, so there is no row change to replicate). Peers apply it as
-- a delete of that key (apply/compensation.rs), through the same conflict
-- rules as any delete; it is newer than every version involved
-- (`not_before`), so it wins on every node. False: not yet (clock, or a
-- user's transaction still writing the table or locking the key's row).
--
-- The table is locked against writers (SHARE ROW EXCLUSIVE) before the
-- delete: a user's INSERT of the key committing between the delete's
-- snapshot and this commit would keep a row here older than the
-- compensation, which loses to it on every other node. Apply sessions are
-- kept out by the agent's gate (compensate.rs). The wait is short
-- (lock_timeout): the agent holds its gate meanwhile, and tries again
-- later rather than stall every stream behind a long user transaction.
CREATE OR REPLACE FUNCTION mm.compensate(p_id bigint) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog SET TimeZone = 'UTC' SET DateStyle = 'ISO'
SET IntervalStyle = 'postgres' SET extra_float_digits = 3 SET lock_timeout = '50ms' AS $fn$
#variable_conflict use_variable
DECLARE
  c record;
  cols text[];
  texts jsonb;
  rel jsonb;
BEGIN
  SELECT * INTO c FROM mm.compensations WHERE id = p_id FOR UPDATE;
  IF NOT FOUND THEN
    RETURN true;
  END IF;
  IF clock_timestamp() <= c.not_before THEN
    RETURN false;
  END IF;
  cols := mm.key_columns(c.relid);
  IF cols IS NULL OR NOT EXISTS (SELECT 1 FROM pg_class WHERE oid = c.relid) THEN
    RAISE WARNING 'mm: compensating delete % of relation % dropped: the table is gone or has no key', c.key, c.relid;
    DELETE FROM mm.compensations WHERE id = p_id;
    RETURN true;
  END IF;
  -- A user's row lock on the key's row holds the delete up just as long.
  BEGIN
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', c.relid::regclass);
    EXECUTE format('DELETE FROM %s r USING pg_catalog.jsonb_populate_record(NULL::%s, $1) p WHERE %s',
                   c.relid::regclass, c.relid::regclass,
                   (SELECT string_agg(format('r.%I = p.%I', k, k), ' AND ') FROM unnest(cols) k))
      USING c.key;
  EXCEPTION WHEN lock_not_available THEN
    RETURN false;
  END;
  EXECUTE format('SELECT pg_catalog.jsonb_build_object(%s) FROM pg_catalog.jsonb_populate_record(NULL::%s, $1) p',
                 (SELECT string_agg(format('%L, p.%I::text', k, k), ', ') FROM unnest(cols) k),
                 c.relid::regclass)
    INTO texts USING c.key;
  SELECT jsonb_build_object(
           'oid', cl.oid::bigint, 'schema', n.nspname, 'table', cl.relname, 'replident', cl.relreplident::text,
           'columns', (SELECT jsonb_agg(jsonb_build_object(
                                'name', a.attname, 'type', a.atttypid::bigint, 'typmod', a.atttypmod,
                                'key', CASE cl.relreplident WHEN 'f' THEN true WHEN 'n' THEN false
                                       ELSE a.attname = ANY (cols) END) ORDER BY a.attnum)
                         FROM pg_attribute a
                        WHERE a.attrelid = cl.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''))
    INTO rel
    FROM pg_class cl JOIN pg_namespace n ON n.oid = cl.relnamespace
   WHERE cl.oid = c.relid;
  INSERT INTO mm.tombstones (relid, key) VALUES (c.relid, c.key)
  ON CONFLICT (relid, pg_catalog.jsonb_hash_extended(key, 0), key) DO UPDATE SET relid = EXCLUDED.relid;
  PERFORM pg_logical_emit_message(true, 'mm.delete', jsonb_build_object('relation', rel, 'key', texts)::text);
  DELETE FROM mm.compensations WHERE id = p_id;
  RETURN true;
END
$fn$;
