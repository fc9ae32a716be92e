-- mm schema version 1: the tables of the first releases. Written with IF NOT
-- EXISTS because nodes set up before versioned migrations already hold them.

-- The Raft state machine's view, for operators (cluster.rs owns it).
CREATE TABLE IF NOT EXISTS mm.nodes (
  id numeric(20) PRIMARY KEY,
  name text NOT NULL UNIQUE,
  api_url text NOT NULL,
  peer_dsn text NOT NULL,
  state text NOT NULL);
CREATE TABLE IF NOT EXISTS mm.raft_applied (
  singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  applied_index bigint NOT NULL);
CREATE TABLE IF NOT EXISTS mm.paused_streams (
  from_node text NOT NULL,
  to_node text NOT NULL,
  PRIMARY KEY (from_node, to_node));

-- Per publisher origin: the end LSN of the last applied remote transaction,
-- written inside that transaction (exactly-once; apply/mod.rs), and the
-- publisher's last watermark, stored with the progress it is valid for.
CREATE TABLE IF NOT EXISTS mm.apply_progress (
  origin text PRIMARY KEY,
  remote_lsn pg_lsn NOT NULL,
  remote_commit_ts timestamptz);
ALTER TABLE mm.apply_progress ADD COLUMN IF NOT EXISTS watermark jsonb;

CREATE TABLE IF NOT EXISTS mm.conflict_log (
  id bigserial PRIMARY KEY,
  at timestamptz NOT NULL DEFAULT now(),
  relation text NOT NULL,
  conflict_type text NOT NULL,
  key jsonb,
  local_origin text,
  local_commit_ts timestamptz,
  remote_origin text,
  remote_commit_ts timestamptz,
  remote_lsn pg_lsn,
  resolution text NOT NULL,
  local_tuple jsonb,
  remote_tuple jsonb);
CREATE INDEX IF NOT EXISTS conflict_log_at ON mm.conflict_log (at);

CREATE TABLE IF NOT EXISTS mm.skip_requests (
  from_node text NOT NULL,
  commit_lsn pg_lsn NOT NULL,
  requested_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (from_node, commit_lsn));

-- Tombstones: one row per deleted key, `(relid, key)`; the row's own xmin
-- carries the delete's origin and commit timestamp through
-- pg_xact_commit_timestamp_origin, exactly like a live row's does.
CREATE TABLE IF NOT EXISTS mm.tombstones (
  relid oid NOT NULL,
  key jsonb NOT NULL,
  PRIMARY KEY (relid, key));

-- A fast-path statement that changed no row (the row is missing): casting
-- its row count to this domain fails unless it is 1, without a function call
-- on the path that succeeds.
DO $do$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_type t JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
                  WHERE n.nspname = 'mm' AND t.typname = 'one_row') THEN
    CREATE DOMAIN mm.one_row AS bigint CONSTRAINT mm_conflict CHECK (VALUE = 1);
  END IF;
END
$do$;
DROP FUNCTION IF EXISTS mm.expect(bigint, bigint);
