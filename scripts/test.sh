#!/usr/bin/env bash
# The whole test suite: README's second command, and what .ci/run calls.
# Runs on a fresh machine with nothing but the pinned toolchain installed.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== unit, integration and doc tests"
cargo test --workspace --all-features

echo "== loom models (--cfg loom, bounded preemptions)"
LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" RUSTFLAGS="--cfg loom" \
    cargo test -p cxlkv-dataplane --release --target-dir target/loom --lib -- loom
