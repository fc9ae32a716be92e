#!/usr/bin/env bash
# Builds the release artifacts of mm: stripped mm-agent and mmctl, a tarball
# holding them with the example config, the systemd unit and the fallback
# supervisor, and SHA-256 checksums of everything.
#
#   scripts/release.sh                     # cargo build --release, artifacts in dist/
#   scripts/release.sh --out DIR           # artifacts in DIR
#   scripts/release.sh --profile debug     # package the debug build (tests: no release build)
#   scripts/release.sh --no-build          # package what the target dir already holds
#
# Output (the version is the workspace's, the target the host's):
#   DIR/mm-<version>-<target>/{bin/mm-agent,bin/mmctl,mm-agent.example.toml,
#                              mm-agent.service,mm-agent-supervise,README.md,LICENSE?}
#   DIR/mm-<version>-<target>.tar.gz
#   DIR/SHA256SUMS                         # the tarball and both binaries
# The last line of stdout is the tarball's path.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd -P)

if [[ -n ${HOME:-} && -d $HOME/.cargo/bin && :$PATH: != *":$HOME/.cargo/bin:"* ]]; then
    PATH="$HOME/.cargo/bin:$PATH"
fi

log() { printf 'release: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

out="$REPO/dist"
profile=release
build=1
while (($#)); do
    case $1 in
    --out)
        (($# >= 2)) || die "--out needs a directory"
        out=$2
        shift 2
        ;;
    --profile)
        (($# >= 2)) || die "--profile needs debug or release"
        profile=$2
        shift 2
        ;;
    --no-build)
        build=0
        shift
        ;;
    -h | --help)
        sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) die "unknown argument $1 (see --help)" ;;
    esac
done
[[ $profile == release || $profile == debug ]] || die "--profile must be debug or release"

command -v cargo >/dev/null || die "cargo not found: install Rust stable"
command -v strip >/dev/null || die "strip not found (apt-get install binutils)"
command -v sha256sum >/dev/null || die "sha256sum not found (coreutils)"

version=$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "mm-agent"))') ||
    die "cannot read the version of mm-agent from cargo metadata"
target=$(rustc -vV | sed -n 's/^host: //p')
[[ -n $target ]] || die "cannot read the host target from rustc -vV"
target_dir=$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')

flags=()
[[ $profile == release ]] && flags=(--release)
if ((build)); then
    log "cargo build ${flags[*]} -p mm-agent --bins"
    cargo build "${flags[@]}" -p mm-agent --bins >&2 || die "cargo build failed"
fi

name="mm-$version-$target"
stage="$out/$name"
mkdir -p "$out"
rm -rf "$stage" "$out/$name.tar.gz"
mkdir -p "$stage/bin"
for bin in mm-agent mmctl; do
    src="$target_dir/$profile/$bin"
    [[ -x $src ]] || die "$src is missing (build it, or drop --no-build)"
    strip -o "$stage/bin/$bin" "$src" || die "strip $src failed"
    "$stage/bin/$bin" --version >/dev/null || die "the stripped $bin does not run"
done
install -m 0644 agent/mm-agent.example.toml "$stage/mm-agent.example.toml"
install -m 0644 ansible/roles/mm_agent/files/mm-agent.service "$stage/mm-agent.service"
install -m 0755 ansible/roles/mm_agent/files/mm-agent-supervise "$stage/mm-agent-supervise"
install -m 0644 README.md "$stage/README.md"

# Reproducible tarball: fixed owner, order and mtime (the last commit's).
mtime=$(git log -1 --format=%ct 2>/dev/null || date +%s)
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$mtime" \
    -C "$out" -czf "$out/$name.tar.gz" "$name" || die "tar failed"
(
    cd "$out"
    sha256sum "$name.tar.gz" "$name/bin/mm-agent" "$name/bin/mmctl" >SHA256SUMS
    sha256sum --quiet -c SHA256SUMS
) || die "checksums failed"
log "built $out/$name.tar.gz ($(du -h "$out/$name.tar.gz" | cut -f1)); checksums in $out/SHA256SUMS"
printf '%s\n' "$out/$name.tar.gz"
