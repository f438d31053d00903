#!/usr/bin/env bash
# The whole test suite: README's second command, and what .ci/run calls.
# Runs on a fresh machine with the pinned toolchain installed; the C
# compiler, pkg-config and python3-venv the C ABI and Python tests need are
# installed from Debian by scripts/setup-dev.sh when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-dev.sh

echo "== unit, integration and doc tests"
cargo test --workspace --all-features

echo "== loom models (--cfg loom, bounded preemptions)"
LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" RUSTFLAGS="--cfg loom" \
    cargo test -p cxlkv-dataplane --release --target-dir target/loom --lib -- loom

echo "== C ABI and Python package (examples, C test incl. ASan, pytest)"
scripts/test-ffi.sh
