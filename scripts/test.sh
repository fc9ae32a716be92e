#!/usr/bin/env bash
# THE one command that checks everything: installs what is missing
# (PostgreSQL, the unprivileged test user, cargo-nextest), then runs format
# check, clippy, every test of the workspace against real PostgreSQL, and
# (as root) the Ansible collection's end-to-end test.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh e2e_crash       # extra args go to the test runner
#
# Environment: MM_PG_BIN (use that PostgreSQL), MM_KEEP_TEST_DIRS=1 (keep
# failed tests' node dirs), RUST_LOG (test tracing).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n ${HOME:-} && -d $HOME/.cargo/bin && :$PATH: != *":$HOME/.cargo/bin:"* ]]; then
    PATH="$HOME/.cargo/bin:$PATH"
fi

declare -a TIMES=() FAILED=()
phase_name="setup"

# run_phase NAME CMD...: runs one phase, records its time and whether it
# failed. Checks keep going after a failure (a formatting nit must not hide
# test results); the script exits non-zero at the end if any phase failed.
run_phase() {
    phase_name=$1
    shift
    local start=$SECONDS rc=0
    printf '\n==> %s\n' "$phase_name" >&2
    "$@" || rc=$?
    local took=$((SECONDS - start))
    local status=ok
    if ((rc != 0)); then
        status="FAILED (exit $rc)"
        FAILED+=("$phase_name")
    fi
    TIMES+=("$(printf '%-22s %5ds  %s' "$phase_name" "$took" "$status")")
    printf '<== %s: %ds, %s\n' "$phase_name" "$took" "$status" >&2
}

summary() {
    local rc=$?
    printf '\nphase times:\n' >&2
    if ((${#TIMES[@]})); then
        printf '  %s\n' "${TIMES[@]}" >&2
    fi
    if ((rc == 0)); then
        printf 'all phases passed in %ds\n' "$SECONDS" >&2
    elif ((${#FAILED[@]})); then
        printf 'FAILED phases: %s\n' "${FAILED[*]}" >&2
    else
        printf 'FAILED in %s (exit %d)\n' "$phase_name" "$rc" >&2
    fi
}
trap summary EXIT

# Phase functions run in an `||` context, where `set -e` does not apply:
# every step that can fail is checked explicitly.
install_postgres() {
    MM_PG_BIN=$(bash scripts/install-postgres.sh | tail -n 1) || return 1
    [[ -n $MM_PG_BIN ]] || return 1
    export MM_PG_BIN
    printf 'MM_PG_BIN=%s\n' "$MM_PG_BIN" >&2
}

ensure_test_user() {
    if [[ $(id -u) != 0 ]]; then
        printf 'not root: servers run as %s\n' "$(id -un)" >&2
        return 0
    fi
    # PostgreSQL refuses to run as root; the harness runs servers as mmtest.
    if ! id mmtest >/dev/null 2>&1; then
        useradd -m -s /bin/sh mmtest || return 1
        printf 'created user mmtest\n' >&2
    fi
}

run_tests() {
    if ! cargo nextest --version >/dev/null 2>&1; then
        printf 'cargo-nextest missing; installing it\n' >&2
        cargo install cargo-nextest --locked ||
            printf 'cannot install cargo-nextest; falling back to cargo test\n' >&2
    fi
    # The seeded randomized suites (e2e_convergence, e2e_identifiers) take
    # MM_SEED; unset, CI would draw a new one every run, and a failure
    # could not be run again. Pinned so a CI run is repeatable; set MM_SEED
    # to explore others (a failing suite names the seed to rerun with).
    export MM_SEED="${MM_SEED:-12}"
    if cargo nextest --version >/dev/null 2>&1; then
        # Test threads and timeouts are set in .config/nextest.toml.
        cargo nextest run --workspace --no-fail-fast "$@"
    else
        RUST_TEST_THREADS=2 cargo test --workspace --no-fail-fast "$@"
    fi
}

# Without PostgreSQL and the test user nothing else can be checked.
run_phase "install PostgreSQL" install_postgres
((${#FAILED[@]} == 0)) || exit 1
run_phase "test user" ensure_test_user
((${#FAILED[@]} == 0)) || exit 1

run_phase "cargo fmt --check" cargo fmt --all -- --check
run_phase "cargo clippy" cargo clippy --workspace --all-targets -- -D warnings
# The end-to-end suites run the real mm-agent and mmctl binaries, which
# building the test targets alone does not produce.
run_phase "build binaries" cargo build --workspace --bins
run_phase "tests" run_tests "$@"
# The Ansible collection against hosts in network namespaces, over SSH
# (scripts/ansible-test.sh): needs root, so developers' non-root runs skip it.
# Not run when test names were given (a filtered run is about Rust tests).
if [[ $(id -u) == 0 && $# -eq 0 ]]; then
    run_phase "ansible" bash scripts/ansible-test.sh
else
    printf '\nskipping the ansible phase (needs root and no test filter): run scripts/ansible-test.sh as root\n' >&2
fi

((${#FAILED[@]} == 0))
