#!/usr/bin/env bash
# Checks that ffi/include/cxlkv.h is what cbindgen generates from ffi/src
# (fails with the first differing line when it is stale). With --write,
# regenerates it instead. cbindgen is a dev-dependency of cxlkv-ffi (pinned
# by Cargo.lock): nothing to install.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
    --write) export CXLKV_WRITE_HEADER=1 ;;
    "") ;;
    *) echo "usage: $0 [--write]" >&2; exit 2 ;;
esac
cargo test -q -p cxlkv-ffi --test header
if [ -n "${CXLKV_WRITE_HEADER:-}" ]; then
    echo "wrote ffi/include/cxlkv.h"
else
    echo "ffi/include/cxlkv.h is up to date"
fi
