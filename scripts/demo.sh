#!/usr/bin/env bash
# A local 3-node mm cluster to try things on, left running:
#
#   scripts/demo.sh [--release]   build, start n1..n3 (PostgreSQL 18 + one
#                                 mm-agent each), form the cluster with mmctl,
#                                 write on every node, wait-sync, show the rows
#   scripts/demo.sh status        mmctl status of the running demo
#   scripts/demo.sh psql NODE     psql into one node (n1, n2, n3)
#   scripts/demo.sh stop          stop agents and servers, remove the demo dirs
#
# Written in bash against the real binaries (initdb/pg_ctl/psql, mm-agent,
# mmctl) rather than through the Rust test harness, because the harness's
# nodes and agents clean themselves up when their owner exits, and the demo
# must outlive this script.
#
# Everything lives under .mm-demo/ in the repository (gitignored): the state
# file listing ports and pids, the copied binaries, secrets, agent dirs and
# logs. PostgreSQL refuses to run as root, so when run as root the servers run
# as the unprivileged user mmtest (created if missing, like scripts/test.sh).
#
# Environment: MM_PG_BIN (use that PostgreSQL instead of installing 18),
# MM_DEMO_NODES (node count, default 3).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd -P)
readonly REPO
readonly DEMO="$REPO/.mm-demo"
readonly STATE="$DEMO/state"
readonly PG_USER_WHEN_ROOT=mmtest

if [[ -n ${HOME:-} && -d $HOME/.cargo/bin && :$PATH: != *":$HOME/.cargo/bin:"* ]]; then
    PATH="$HOME/.cargo/bin:$PATH"
fi

say() { printf '\n==> %s\n' "$*"; }
log() { printf 'demo: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

usage() {
    sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

is_root() { [[ $(id -u) == 0 ]]; }

pg_user() {
    if is_root; then
        printf '%s\n' "$PG_USER_WHEN_ROOT"
    else
        id -un
    fi
}

# Runs a PostgreSQL server program as the user the servers run as. From /,
# because the invoking directory may not be readable by that user.
as_pg() {
    if is_root; then
        (cd / && runuser -u "$PG_USER_WHEN_ROOT" -- "$@")
    else
        "$@"
    fi
}

# Gives a path to the server user (no-op when that is us).
give_to_pg() {
    if is_root; then
        chown "$PG_USER_WHEN_ROOT:" "$@"
    fi
}

# --- the state file: "key=value" lines, appended as things start, so that
# `stop` (and cleanup after a failed start) finds whatever did start. The
# last line for a key wins. Read line by line, never sourced.

state_set() {
    printf '%s=%s\n' "$1" "$2" >>"$STATE"
}

state_get() {
    local key=$1 line value=""
    [[ -f $STATE ]] || return 0
    while IFS= read -r line; do
        if [[ ${line%%=*} == "$key" ]]; then
            value=${line#*=}
        fi
    done <"$STATE"
    printf '%s\n' "$value"
}

state_nodes() {
    local line
    [[ -f $STATE ]] || return 0
    while IFS= read -r line; do
        if [[ $line == node=* ]]; then
            printf '%s\n' "${line#node=}"
        fi
    done <"$STATE"
}

# The demo's nodes as the array NODES. (No `state_nodes | head` pipelines:
# under pipefail, head closing the pipe early fails them with SIGPIPE.)
load_nodes() {
    NODES=()
    mapfile -t NODES < <(state_nodes)
}

# --- processes

pid_alive() { [[ -n $1 ]] && kill -0 "$1" 2>/dev/null; }

# True when pid $1 is alive and its command line contains $2: pids are only
# signalled after this check, so a recycled pid is never killed by mistake.
pid_runs() {
    local pid=$1 needle=$2 cmdline
    pid_alive "$pid" || return 1
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ $cmdline == *"$needle"* ]]
}

# SIGTERM, then SIGKILL after $3 seconds.
stop_pid() {
    local pid=$1 what=$2 grace=$3 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < grace * 10; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    log "$what (pid $pid) ignored SIGTERM for ${grace}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

# A TCP port on 127.0.0.1 that nothing listens on now, outside the kernel's
# ephemeral range (so an outgoing connection cannot take it meanwhile) and
# not handed out before by this run. Sets PORT (no subshell, so the list of
# handed-out ports survives). Servers still retry with another port if they
# lose a race for it.
TAKEN=" "
PORT=""
pick_port() {
    local i
    for ((i = 0; i < 200; i++)); do
        PORT=$((20000 + RANDOM % 12000))
        [[ $TAKEN == *" $PORT "* ]] && continue
        if ! timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT" 2>/dev/null; then
            TAKEN+="$PORT "
            return 0
        fi
    done
    die "cannot find a free TCP port on 127.0.0.1"
}

random_hex() {
    od -An -N "$1" -tx1 /dev/urandom | tr -d ' \n'
}

# --- stop

stop_demo() {
    if [[ ! -f $STATE ]]; then
        if [[ -d $DEMO ]]; then
            rm -rf "$DEMO"
            log "removed $DEMO (no demo was running)"
        else
            log "no demo is running"
        fi
        return 0
    fi
    local pg_bin pg_root node pid data
    pg_bin=$(state_get pg_bin)
    pg_root=$(state_get pg_root)
    # Agents first: they hold replication connections into every server.
    for node in $(state_nodes); do
        pid=$(state_get "$node.agent_pid")
        if [[ -n $pid ]] && pid_runs "$pid" "$DEMO/$node/agent.toml"; then
            stop_pid "$pid" "agent $node" 10
            log "stopped agent $node (pid $pid)"
        fi
    done
    for node in $(state_nodes); do
        data=$(state_get "$node.pg_data")
        [[ -n $data && -f $data/postmaster.pid ]] || continue
        pid=$(head -n 1 "$data/postmaster.pid" 2>/dev/null || true)
        if [[ -n $pg_bin ]] && as_pg "$pg_bin/pg_ctl" stop -D "$data" -m fast -w -t 30 -s; then
            log "stopped PostgreSQL $node"
        elif [[ -n $pid ]] && pid_runs "$pid" "$data"; then
            kill -KILL "$pid" 2>/dev/null || true
            log "killed PostgreSQL $node (postmaster pid $pid)"
        fi
    done
    # pg_root is either inside $DEMO or a private dir under /var/tmp that
    # this script created; refuse to delete anything else.
    if [[ -n $pg_root && $pg_root != "$DEMO"/* ]]; then
        if [[ $pg_root == /var/tmp/mm-demo-* ]]; then
            rm -rf "$pg_root"
        else
            log "not removing unexpected pg_root $pg_root"
        fi
    fi
    rm -rf "$DEMO"
    log "demo stopped; removed $DEMO"
}

# --- start

START_DONE=0

# On a failed or interrupted start: show what the logs say, then remove
# everything this run started, so a failed demo leaves nothing behind.
on_start_exit() {
    local rc=$?
    ((START_DONE)) && return 0
    trap - EXIT INT TERM ERR
    log "the demo did not start (exit $rc); last log lines:"
    local node f
    for node in $(state_nodes); do
        for f in "$DEMO/$node/agent.log" "$(state_get "$node.pg_dir")/postgres.log"; do
            if [[ -f $f ]]; then
                printf -- '--- %s ---\n' "$f" >&2
                tail -n 10 "$f" >&2 || true
            fi
        done
    done
    stop_demo || true
    exit "$rc"
}

# Builds mm-agent and mmctl and copies them into $DEMO/bin, so the running
# demo keeps its binaries even when the workspace is rebuilt meanwhile.
build_binaries() {
    command -v cargo >/dev/null || die "cargo not found: install Rust stable (https://rustup.rs)"
    local -a flags=()
    [[ $RELEASE == 1 ]] && flags=(--release)
    say "building mm-agent and mmctl (${PROFILE})"
    local json
    json=$(cargo build "${flags[@]}" -p mm-agent --bins --message-format=json-render-diagnostics) ||
        die "cargo build failed"
    mkdir -p "$DEMO/bin"
    local name path
    for name in mm-agent mmctl; do
        path=$(grep -o "\"executable\":\"[^\"]*/$name\"" <<<"$json" | tail -n 1 | cut -d'"' -f4)
        [[ -n $path && -x $path ]] || die "cargo did not report the $name binary"
        cp "$path" "$DEMO/bin/$name.tmp"
        mv "$DEMO/bin/$name.tmp" "$DEMO/bin/$name"
    done
}

install_postgres() {
    say "installing PostgreSQL (scripts/install-postgres.sh)"
    PG_BIN=$(bash scripts/install-postgres.sh | tail -n 1) ||
        die "scripts/install-postgres.sh failed (see above; it needs python3 with pip: apt-get install python3-pip)"
    [[ -x $PG_BIN/initdb && -x $PG_BIN/pg_ctl && -x $PG_BIN/psql ]] ||
        die "$PG_BIN lacks initdb, pg_ctl or psql"
    state_set pg_bin "$PG_BIN"
    "$PG_BIN/postgres" --version
}

ensure_pg_user() {
    is_root || return 0
    if ! id "$PG_USER_WHEN_ROOT" >/dev/null 2>&1; then
        useradd -m -s /bin/sh "$PG_USER_WHEN_ROOT" || die "useradd $PG_USER_WHEN_ROOT failed"
        log "created user $PG_USER_WHEN_ROOT (PostgreSQL refuses to run as root)"
    fi
}

# Where the server dirs go: $DEMO/pg when the server user can reach it (and
# the unix socket path stays under the kernel's 107-byte limit), else a
# private dir under /var/tmp (e.g. a checkout under /root, which mmtest
# cannot traverse).
choose_pg_root() {
    PG_ROOT="$DEMO/pg"
    mkdir -p "$PG_ROOT"
    give_to_pg "$PG_ROOT"
    chmod 0700 "$PG_ROOT"
    if ((${#PG_ROOT} > 80)) || ! as_pg test -w "$PG_ROOT" -a -x "$PG_ROOT"; then
        rmdir "$PG_ROOT"
        PG_ROOT=$(mktemp -d /var/tmp/mm-demo-XXXXXX)
        give_to_pg "$PG_ROOT"
        chmod 0700 "$PG_ROOT"
    fi
    state_set pg_root "$PG_ROOT"
}

write_secrets() {
    (
        umask 077
        random_hex 24 >"$DEMO/token"
        PG_PASSWORD=$(random_hex 16)
        printf '%s\n' "$PG_PASSWORD" >"$DEMO/pg-password"
        # libpq's password file, for psql (the agent reads pg-password).
        printf '127.0.0.1:*:*:postgres:%s\n' "$PG_PASSWORD" >"$DEMO/pgpass"
    )
}

# psql as the invoking user over TCP, authenticating with the demo password.
demo_psql() {
    local port=$1
    shift
    PGPASSFILE="$DEMO/pgpass" "$PG_BIN/psql" -X -v ON_ERROR_STOP=1 \
        "host=127.0.0.1 port=$port user=postgres dbname=postgres" "$@"
}

start_postgres() {
    local node=$1 dir="$PG_ROOT/$1" data="$PG_ROOT/$1/data" attempt port
    mkdir -p "$dir"
    give_to_pg "$dir"
    chmod 0700 "$dir"
    state_set "$node.pg_dir" "$dir"
    state_set "$node.pg_data" "$data"
    # initdb reads the superuser password from a file the server user owns.
    install -m 0600 "$DEMO/pg-password" "$dir/pwfile"
    give_to_pg "$dir/pwfile"
    as_pg "$PG_BIN/initdb" -D "$data" -U postgres --pwfile="$dir/pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 \
        -E UTF8 --locale=C --no-sync --no-instructions >"$dir/initdb.log" 2>&1 ||
        die "initdb for $node failed: $(tail -n 5 "$dir/initdb.log")"
    rm -f "$dir/pwfile"
    printf "\n# mm demo settings\ninclude = 'mm-demo.conf'\n" >>"$data/postgresql.conf"
    for attempt in 1 2 3 4 5; do
        pick_port
        port=$PORT
        # SPEC §2: logical WAL, commit timestamps, and at least
        # 2 x (nodes - 1) + 2 slots and senders (with room to add nodes).
        cat >"$data/mm-demo.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
unix_socket_permissions = 0700
wal_level = logical
track_commit_timestamp = on
max_replication_slots = 20
max_wal_senders = 20
max_connections = 50
shared_buffers = '64MB'
timezone = 'UTC'
log_timezone = 'UTC'
log_line_prefix = '%m [%p] %q%a '
EOF
        give_to_pg "$data/mm-demo.conf"
        if as_pg "$PG_BIN/pg_ctl" start -D "$data" -l "$dir/postgres.log" -w -t 60 -s >/dev/null; then
            state_set "$node.pg_port" "$port"
            printf '%s: PostgreSQL on 127.0.0.1:%s (data %s)\n' "$node" "$port" "$data"
            return 0
        fi
        grep -q 'Address already in use' "$dir/postgres.log" 2>/dev/null ||
            die "PostgreSQL $node did not start: $(tail -n 5 "$dir/postgres.log" 2>/dev/null)"
        log "port $port of $node was taken meanwhile; retrying (attempt $attempt)"
    done
    die "PostgreSQL $node did not start: no free port"
}

# The replicated table must exist, empty, on every node before its agent
# starts (DDL is not replicated).
create_schema() {
    local node=$1 port
    port=$(state_get "$node.pg_port")
    demo_psql "$port" -q -c "CREATE TABLE public.demo (
        id int PRIMARY KEY,
        written_on text NOT NULL,
        note text NOT NULL)"
}

# Starts the agent and waits until its API listens; a lost port race is
# retried with another port.
start_agent() {
    local node=$1 dir="$DEMO/$1" pg_port port attempt pid i
    pg_port=$(state_get "$node.pg_port")
    mkdir -p "$dir/data"
    for attempt in 1 2 3 4 5; do
        pick_port
        port=$PORT
        # SPEC §3. Locally and for peers the node is reached over loopback.
        cat >"$dir/agent.toml" <<EOF
[node]
name = "$node"
data_dir = "$dir/data"

[postgres]
dsn = "host=127.0.0.1 port=$pg_port user=postgres dbname=postgres"
peer_dsn = "host=127.0.0.1 port=$pg_port user=postgres dbname=postgres"
password_file = "$DEMO/pg-password"

[api]
listen = "127.0.0.1:$port"
advertise = "http://127.0.0.1:$port"
token_file = "$DEMO/token"

[replication]
schemas = ["public"]
EOF
        # setsid: its own session, so closing this terminal does not stop it.
        # NO_COLOR: the log is a file, not a terminal.
        NO_COLOR=1 setsid "$DEMO/bin/mm-agent" --config "$dir/agent.toml" \
            </dev/null >>"$dir/agent.log" 2>&1 &
        pid=$!
        state_set "$node.agent_pid" "$pid"
        for ((i = 0; i < 300; i++)); do
            pid_alive "$pid" || break
            if timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null; then
                state_set "$node.api_port" "$port"
                printf '%s: mm-agent pid %s, API http://127.0.0.1:%s (log %s)\n' \
                    "$node" "$pid" "$port" "$dir/agent.log"
                return 0
            fi
            sleep 0.1
        done
        if pid_alive "$pid"; then
            die "agent $node does not listen on 127.0.0.1:$port after 30s"
        fi
        wait "$pid" 2>/dev/null || true
        grep -q 'binding api.listen' "$dir/agent.log" ||
            die "agent $node exited: $(tail -n 5 "$dir/agent.log")"
        log "port $port of agent $node was taken meanwhile; retrying (attempt $attempt)"
    done
    die "agent $node did not start: no free port"
}

mmctl_demo() {
    local port
    load_nodes
    port=$(state_get "${NODES[0]}.api_port")
    "$DEMO/bin/mmctl" --agent "http://127.0.0.1:$port" --token-file "$DEMO/token" "$@"
}

# Shows `sql` on every node and fails unless all nodes return the same rows.
show_same_rows() {
    local sql=$1 node port first="" rows first_node=""
    for node in $(state_nodes); do
        port=$(state_get "$node.pg_port")
        printf -- '\n-- %s (127.0.0.1:%s): %s\n' "$node" "$port" "$sql"
        demo_psql "$port" -c "$sql"
        rows=$(demo_psql "$port" -At -c "$sql")
        if [[ -z $first_node ]]; then
            first=$rows
            first_node=$node
        elif [[ $rows != "$first" ]]; then
            die "$node's rows differ from $first_node's:
$first_node:
$first
$node:
$rows"
        fi
    done
    load_nodes
    printf '\nall %s nodes hold the same rows\n' "${#NODES[@]}"
}

start_demo() {
    local nodes=${MM_DEMO_NODES:-3} node i port
    if ! [[ $nodes =~ ^[2-9]$ ]]; then
        die "MM_DEMO_NODES must be 2..9"
    fi
    if [[ -f $STATE ]]; then
        log "a demo is already running; stopping it first"
        stop_demo
    elif [[ -d $DEMO ]]; then
        rm -rf "$DEMO"
    fi

    mkdir -p "$DEMO"
    # Traversable by the server user, not listable by others.
    chmod 0711 "$DEMO"
    : >"$STATE"
    trap on_start_exit EXIT
    trap 'exit 130' INT TERM
    # Name the command that failed, not only the exit code.
    set -E
    trap 'log "failed (exit $?) at scripts/demo.sh line $LINENO: $BASH_COMMAND"' ERR
    state_set started "$(date -u +%FT%TZ)"
    state_set profile "$PROFILE"

    build_binaries
    install_postgres
    ensure_pg_user
    state_set pg_user "$(pg_user)"
    for ((i = 1; i <= nodes; i++)); do
        state_set node "n$i"
    done
    write_secrets
    choose_pg_root

    say "starting $nodes PostgreSQL nodes (as user $(pg_user))"
    for node in $(state_nodes); do
        start_postgres "$node"
        create_schema "$node"
    done

    say "starting one mm-agent beside each node"
    for node in $(state_nodes); do
        start_agent "$node"
    done

    load_nodes
    local first=${NODES[0]}
    say "forming the cluster: mmctl init on $first, then mmctl add-node for the others"
    mmctl_demo init
    for node in "${NODES[@]:1}"; do
        port=$(state_get "$node.api_port")
        mmctl_demo add-node --name "$node" --url "http://127.0.0.1:$port"
    done

    say "writing on every node: each inserts two rows in one transaction"
    i=0
    for node in $(state_nodes); do
        port=$(state_get "$node.pg_port")
        demo_psql "$port" -q -c "INSERT INTO demo (id, written_on, note) VALUES
            ($((i * 2 + 1)), '$node', 'inserted on $node'),
            ($((i * 2 + 2)), '$node', 'inserted on $node')"
        printf '%s: inserted rows %s and %s\n' "$node" $((i * 2 + 1)) $((i * 2 + 2))
        i=$((i + 1))
    done
    say "mmctl wait-sync"
    mmctl_demo wait-sync --timeout 60

    # Each node changes a row another node wrote: the second node updates
    # one of the first's, the last deletes one of the second's (or of the
    # first's, when there are only two).
    local second=${NODES[1]} last=${NODES[-1]} victim=4 victim_node=${NODES[1]}
    if ((${#NODES[@]} == 2)); then
        victim=2
        victim_node=$first
    fi
    say "changing other nodes' rows: $second updates row 1 (from $first), $last deletes row $victim (from $victim_node)"
    demo_psql "$(state_get "$second.pg_port")" -q \
        -c "UPDATE demo SET note = 'updated on $second' WHERE id = 1"
    demo_psql "$(state_get "$last.pg_port")" -q -c "DELETE FROM demo WHERE id = $victim"
    say "mmctl wait-sync"
    mmctl_demo wait-sync --timeout 60

    say "the same rows on every node"
    show_same_rows "SELECT id, written_on, note FROM demo ORDER BY id"

    say "mmctl status"
    mmctl_demo status

    START_DONE=1
    trap - EXIT INT TERM ERR
    print_usage_help
}

print_usage_help() {
    local first port node
    load_nodes
    first=${NODES[0]}
    port=$(state_get "$first.api_port")
    say "the demo cluster is running (state: $STATE)"
    printf 'mmctl (any agent works):\n'
    printf '  %s --agent http://127.0.0.1:%s --token-file %s status\n' \
        "$DEMO/bin/mmctl" "$port" "$DEMO/token"
    printf '  (or: export MM_AGENT=http://127.0.0.1:%s MM_TOKEN_FILE=%s)\n' "$port" "$DEMO/token"
    printf 'psql (user postgres; the password is in %s):\n' "$DEMO/pg-password"
    for node in $(state_nodes); do
        printf '  %s: PGPASSFILE=%s %s/psql "host=127.0.0.1 port=%s user=postgres dbname=postgres"\n' \
            "$node" "$DEMO/pgpass" "$(state_get pg_bin)" "$(state_get "$node.pg_port")"
    done
    printf 'agent logs: %s/<node>/agent.log; agent configs: %s/<node>/agent.toml\n' "$DEMO" "$DEMO"
    printf 'shortcuts: scripts/demo.sh status | scripts/demo.sh psql %s\n' "$first"
    printf 'to stop it and remove its dirs, run: scripts/demo.sh stop\n'
}

require_running() {
    [[ -f $STATE && -x $DEMO/bin/mmctl ]] || die "no demo is running (start one with scripts/demo.sh)"
    PG_BIN=$(state_get pg_bin)
}

RELEASE=0
PROFILE=debug
COMMAND=start
if [[ $# -gt 0 && $1 != -* ]]; then
    COMMAND=$1
    shift
fi

case $COMMAND in
start)
    for arg in "$@"; do
        case $arg in
        --release)
            RELEASE=1
            PROFILE=release
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *) die "unexpected argument $arg; see scripts/demo.sh --help" ;;
        esac
    done
    start_demo
    ;;
stop)
    stop_demo
    ;;
status)
    require_running
    mmctl_demo status "$@"
    ;;
psql)
    require_running
    (($# >= 1)) || die "usage: scripts/demo.sh psql NODE [psql arguments]"
    port=$(state_get "$1.pg_port")
    [[ -n $port ]] || die "no node $1 in the demo (nodes: $(state_nodes | tr '\n' ' ' || true))"
    shift
    demo_psql "$port" "$@"
    ;;
*)
    die "unknown command $COMMAND; see scripts/demo.sh --help"
    ;;
esac
