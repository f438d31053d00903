#!/usr/bin/env bash
# Installs what the test suite needs beyond the pinned Rust toolchain, from
# Debian's archive: a C and C++ compiler (the C ABI's examples and tests,
# AddressSanitizer's runtime comes with gcc), pkg-config and binutils (the
# installed library is found through cxlkv.pc; `nm` lists its exports), and
# python3 with venv (the Python package's pytest suite; pytest itself comes
# from PyPI into a throwaway venv).
#
#   scripts/setup-dev.sh           install what is missing (needs root + apt)
#   scripts/setup-dev.sh --check   only report what is missing (exit 1 if any)
#
# Does nothing when everything is present, so scripts/test.sh calls it first.
set -euo pipefail

check_only=0
case "${1:-}" in
    "") ;;
    --check) check_only=1 ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

missing=()
need() { # <command> <debian package>
    command -v "$1" >/dev/null 2>&1 || missing+=("$2")
}
need cc gcc
need c++ g++
need pkg-config pkg-config
need nm binutils
need python3 python3
# The venv module is a separate Debian package; probe it without creating
# anything.
if command -v python3 >/dev/null 2>&1 &&
    ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi

if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
echo "setup-dev: missing: ${missing[*]}" >&2
if [ "$check_only" = 1 ]; then
    exit 1
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-dev: install them with your package manager (needs root and apt-get here)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
