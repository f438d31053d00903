#!/usr/bin/env bash
# The C ABI's tests from outside Rust:
#   1. builds libcxlkv and the `cxlkv` binary, installs the library into a
#      temporary prefix (scripts/install-ffi.sh) and checks the header is
#      current and the docs show the example files;
#   2. checks that the C test calls every symbol the library exports;
#   3. compiles the C and C++ examples and the C test with -Wall -Wextra
#      -Werror against the installed header and library (pkg-config), plus
#      the C test under AddressSanitizer and statically linked;
#   4. starts a real server process (`cxlkv serve`) and runs: the C test (plain, ASan,
#      static), producer -> consumer across processes in C, in C++, mixed,
#      and with the consumer started first; the L1 tier example;
#   5. the Python package: pip install into a fresh venv, then pytest.
# Everything it creates lives under one temporary directory, removed at
# exit with the server it started.
#
# usage: scripts/test-ffi.sh [--release] [--no-python]
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

profile=debug python=1
for arg in "$@"; do
    case "$arg" in
        --release) profile=release ;;
        --no-python) python=0 ;;
        *) echo "usage: $0 [--release] [--no-python]" >&2; exit 2 ;;
    esac
done
cargo_profile=()
[ "$profile" = release ] && cargo_profile=(--release)

work="$(mktemp -d /tmp/cxlkv-ffi-test.XXXXXX)"
pool="/dev/shm/cxlkv-ffi-test-$$.pool"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work" "$pool"
}
trap cleanup EXIT
step() { echo "== $*"; }
started=$SECONDS

step "build libcxlkv and cxlkv ($profile)"
cargo build -q "${cargo_profile[@]}" -p cxlkv-ffi --lib
cargo build -q "${cargo_profile[@]}" -p cxlkv --bin cxlkv
target_dir="$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
cxlkv_bin="$target_dir/$profile/cxlkv"
prefix="$work/prefix"
install_flags=(--no-build)
[ "$profile" = debug ] && install_flags+=(--debug)
scripts/install-ffi.sh "$prefix" "${install_flags[@]}"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"

step "header is current, doc examples match their files"
scripts/check-header.sh
cargo test -q -p cxlkv-ffi --test docs

step "the C test calls every exported function"
missing=0
for sym in $(nm -D --defined-only "$prefix/lib/libcxlkv.so" | awk '$2 == "T" { print $3 }' | grep '^cxlkv_'); do
    if ! grep -q "\b$sym(" ffi/tests/c/api_test.c; then
        echo "not exercised by ffi/tests/c/api_test.c: $sym" >&2
        missing=1
    fi
done
[ "$missing" = 0 ]

step "compile (C11 and C++17, -Wall -Wextra -Werror -pedantic)"
bin="$work/bin"
mkdir -p "$bin"
cflags=(-std=c11 -Wall -Wextra -Werror -pedantic -g)
cxxflags=(-std=c++17 -Wall -Wextra -Werror -pedantic -g)
read -r -a pc <<<"$(pkg-config --cflags --libs cxlkv)"
# The static link: the archive itself plus the system libraries it needs.
read -r -a static_libs <<<"$(pkg-config --static --libs-only-l cxlkv | sed 's/-lcxlkv//')"
rpath=(-Wl,-rpath,"$prefix/lib")
cc "${cflags[@]}" ffi/examples/c/tier.c "${pc[@]}" "${rpath[@]}" -o "$bin/c-tier"
for ex in producer consumer; do
    cc "${cflags[@]}" "ffi/examples/c/$ex.c" "${pc[@]}" "${rpath[@]}" -o "$bin/c-$ex"
    c++ "${cxxflags[@]}" "ffi/examples/cpp/$ex.cpp" "${pc[@]}" "${rpath[@]}" -o "$bin/cpp-$ex"
done
cc "${cflags[@]}" ffi/tests/c/api_test.c "${pc[@]}" "${rpath[@]}" -pthread -o "$bin/api_test"
cc "${cflags[@]}" -fsanitize=address -fno-omit-frame-pointer ffi/tests/c/api_test.c \
    "${pc[@]}" "${rpath[@]}" -pthread -o "$bin/api_test_asan"
cc "${cflags[@]}" ffi/tests/c/api_test.c $(pkg-config --cflags cxlkv) "$prefix/lib/libcxlkv.a" \
    "${static_libs[@]}" -pthread -o "$bin/api_test_static"
if readelf -d "$bin/api_test_static" | grep -q 'libcxlkv'; then
    echo "api_test_static depends on libcxlkv.so" >&2
    exit 1
fi

step "start a server (cxlkv serve)"
socket="$work/cxlkv.sock"
CXLKV_LOG=warn "$cxlkv_bin" serve --socket "$socket" --pool "$pool,size=256MiB" \
    --state-dir "$work/state" >"$work/server.out" 2>"$work/server.err" &
server_pid=$!
for _ in $(seq 1 300); do
    grep -q '^listening' "$work/server.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.err" >&2; exit 1; }
    sleep 0.1
done
grep -q '^listening' "$work/server.out" || { echo "cxlkv serve did not start" >&2; exit 1; }

step "C test (plain, AddressSanitizer, static)"
"$bin/api_test" "$socket"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=86 "$bin/api_test_asan" "$socket"
"$bin/api_test_static" "$socket"

step "the L1 tier example"
"$bin/c-tier" "$socket"

step "producer -> consumer across processes"
"$bin/c-producer" "$socket" 32
"$bin/c-consumer" "$socket" 32
"$bin/cpp-producer" "$socket" 32
"$bin/cpp-consumer" "$socket" 32
"$bin/c-producer" "$socket" 8
"$bin/cpp-consumer" "$socket" 8
"$bin/cpp-producer" "$socket" 8
"$bin/c-consumer" "$socket" 8
# The consumer first: it waits for the producer's keys.
"$bin/c-consumer" "$socket" 16 &
consumer=$!
sleep 0.2
"$bin/cpp-producer" "$socket" 16
wait "$consumer"

if [ "$python" = 1 ]; then
    step "Python package: pip install into a venv, pytest"
    # ensurepip has been seen to fail once on a loaded machine; one retry
    # from scratch, then the error stands.
    if ! python3 -m venv "$work/venv"; then
        echo "python3 -m venv failed; retrying once" >&2
        rm -rf "$work/venv"
        python3 -m venv "$work/venv"
    fi
    "$work/venv/bin/pip" install -q --disable-pip-version-check pytest
    CXLKV_LIB="$prefix/lib/libcxlkv.so" "$work/venv/bin/pip" install -q --disable-pip-version-check ./python
    (
        cd "$work"   # import the installed package, not the source tree
        CXLKV_BIN="$cxlkv_bin" CXLKV_TEST_C_PRODUCER="$bin/c-producer" \
            "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
            "$repo/python/tests"
    )
fi

step "stop the server"
kill -TERM "$server_pid"
wait "$server_pid"   # exits 0 after a graceful shutdown
server_pid=""
echo "scripts/test-ffi.sh: all passed in $((SECONDS - started)) s"
