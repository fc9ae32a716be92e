-- mm schema version 8: tombstones are found by their key's hash first.
--
-- The primary key (relid, key jsonb) compared jsonb at every step of
-- every index descent: each comparison copies the stored key out of its
-- short header, walks both containers and compares numbers as numerics.
-- That was a third of the apply backend's CPU for a backlog of deletes
-- (perf: detoast_attr, JsonbIteratorNext, compareJsonbContainers,
-- cmp_numerics). With the key's hash between relid and key, descents
-- compare two integers and reach the key only on the hash's own entries.
-- jsonb_hash_extended agrees with jsonb equality (1.0 and 1.00 hash the
-- same), so uniqueness is that of (relid, key), as before.
--
-- An expression index, not a generated column: adding a stored column
-- rewrites the table, and a rewrite gives every row a new xmin, which is
-- a tombstone's version (origin and commit timestamp). Lookups and
-- ON CONFLICT name the same expression (apply/sql.rs, functions.sql).
ALTER TABLE mm.tombstones DROP CONSTRAINT IF EXISTS tombstones_pkey;
CREATE UNIQUE INDEX IF NOT EXISTS mm_tombstones_key
  ON mm.tombstones (relid, pg_catalog.jsonb_hash_extended(key, 0), key);
