#!/usr/bin/env bash
# The benchmark: mm vs PostgreSQL's native logical replication, both on this
# machine with the same PostgreSQL build, in one run, reported as ratios
# mm/native. Builds RELEASE binaries (a debug agent would measure the
# compiler, not the design) and runs mm-bench with them.
#
#   scripts/bench.sh                 # full run: 200k rows per workload, 25 s TPC-B,
#                                    # the conflicts workload (disjoint vs hot keys)
#   scripts/bench.sh --quick         # ~1 minute smoke run
#   scripts/bench.sh --rows 50000 --only 1,2
#   scripts/bench.sh conflicts       # only the conflicts workload (= --only 5), < 1 minute
#
# Arguments go to mm-bench (see `scripts/bench.sh --help`). Environment:
# MM_PG_BIN (use that PostgreSQL), MM_BENCH_<FLAG> defaults for every flag.
# The results table (markdown) is printed at the end of stdout.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n ${HOME:-} && -d $HOME/.cargo/bin && :$PATH: != *":$HOME/.cargo/bin:"* ]]; then
    PATH="$HOME/.cargo/bin:$PATH"
fi

MM_PG_BIN=$(bash scripts/install-postgres.sh | tail -n 1)
[[ -n $MM_PG_BIN ]] || { echo "bench: no PostgreSQL bin dir" >&2; exit 1; }
export MM_PG_BIN

# PostgreSQL refuses to run as root; the harness runs servers as mmtest.
if [[ $(id -u) == 0 ]] && ! id mmtest >/dev/null 2>&1; then
    useradd -m -s /bin/sh mmtest
fi

# `bench.sh join [--rows N] [--versions K]`: add-node's copy vs pg_dump|psql.
bench_bin=mm-bench
if [[ ${1:-} == join ]]; then
    shift
    bench_bin=join-bench
fi
cargo build --release -p mm-agent --bins -p mm-bench --bin "$bench_bin"

# Wherever this checkout builds to (.cargo/config.toml or CARGO_TARGET_DIR).
target=$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[[ -n $target ]] || { echo "bench: cannot find the cargo target dir" >&2; exit 1; }

export MM_AGENT_BIN="$target/release/mm-agent"
export MMCTL_BIN="$target/release/mmctl"
exec "$target/release/$bench_bin" "$@"
