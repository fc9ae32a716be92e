-- mm schema version 3: per-table truncate versions. A TRUNCATE is a
-- tombstone for every key of its table: the row's xmin carries the
-- truncate's origin and commit timestamp (pg_xact_commit_timestamp_origin),
-- like a tombstone's. Incoming changes older than it are discarded on every
-- node; newer ones apply (apply/careful.rs, mm.apply_truncate).
CREATE TABLE mm.truncates (
  relid oid PRIMARY KEY);
