#!/usr/bin/env bash
# Runs every cargo-fuzz target in the repository (each `*/fuzz/` crate) for a
# total fuzzing budget split evenly across targets, starting from the
# committed seed corpus (`fuzz/seeds/<target>/`) plus whatever earlier runs
# left in `fuzz/corpus/<target>/` (not committed). Exits non-zero on the
# first crash; the reproducer is in `fuzz/artifacts/<target>/`.
#
#   scripts/fuzz.sh [seconds]     default 60 (the CI budget)
#
# With five targets the CI budget gives each 12 s: enough to replay the seed
# corpus and run tens of thousands of mutations of each decoder (a smoke test
# that catches a regression on the committed seeds), far from a campaign. The
# campaigns and their figures are in docs/reliability.md.
#
# Building the instrumented targets takes a few minutes the first time and is
# not counted in the budget. Long runs (before a release, or after touching
# frame.rs or proto/): give an hour, or run one target on every core:
#
#   scripts/fuzz.sh 3600
#   cd controlplane && cargo +nightly fuzz run frame_decode \
#       fuzz/corpus/frame_decode fuzz/seeds/frame_decode -- -max_total_time=3600 -fork=2
#
# Reproduce a crash:  cd controlplane && cargo +nightly fuzz run frame_decode <artifact>
set -euo pipefail
cd "$(dirname "$0")/.."

total_s="${1:-60}"
if ! [[ "$total_s" =~ ^[0-9]+$ ]] || [ "$total_s" -lt 1 ]; then
    echo "usage: $0 [seconds]   (a positive whole number of seconds)" >&2
    exit 2
fi

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz (a few minutes, once)"
    cargo install cargo-fuzz --locked
fi

# "<crate dir> <target>" for every target of every fuzz crate.
mapfile -t targets < <(
    find . -path ./target -prune -o -path '*/fuzz/Cargo.toml' -print | sort |
        while read -r manifest; do
            crate_dir="$(dirname "$(dirname "$manifest")")"
            (cd "$crate_dir" && cargo +nightly fuzz list) | sed "s|^|$crate_dir |"
        done
)
if [ "${#targets[@]}" -eq 0 ]; then
    echo "no fuzz targets found" >&2
    exit 1
fi
per_target_s=$(( total_s / ${#targets[@]} ))
[ "$per_target_s" -ge 1 ] || per_target_s=1

for entry in "${targets[@]}"; do
    read -r crate_dir target <<<"$entry"
    echo "== fuzz $crate_dir:$target for ${per_target_s}s"
    (
        cd "$crate_dir"
        corpus="fuzz/corpus/$target"
        mkdir -p "$corpus"
        dirs=("$corpus")
        [ -d "fuzz/seeds/$target" ] && dirs+=("fuzz/seeds/$target")
        cargo +nightly fuzz run "$target" "${dirs[@]}" -- \
            -max_total_time="$per_target_s" -print_final_stats=1
    )
done
