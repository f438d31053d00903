#!/usr/bin/env bash
# Installs the C ABI: builds libcxlkv (release) and lays out
#   PREFIX/include/cxlkv.h
#   PREFIX/lib/libcxlkv.so.X.Y.Z, libcxlkv.so.X -> .X.Y.Z, libcxlkv.so -> .X
#   PREFIX/lib/libcxlkv.a
#   PREFIX/lib/pkgconfig/cxlkv.pc
# so that `cc $(pkg-config --cflags --libs cxlkv)` (PKG_CONFIG_PATH set to
# PREFIX/lib/pkgconfig for a non-system prefix) builds against it, and
# `pkg-config --static --libs cxlkv` links libcxlkv.a.
#
# usage: scripts/install-ffi.sh PREFIX [--debug] [--no-build]
#   --debug     install the debug build (target/debug) instead of release
#   --no-build  install what target/ already holds
set -euo pipefail
cd "$(dirname "$0")/.."

prefix="" profile=release build=1
for arg in "$@"; do
    case "$arg" in
        --debug) profile=debug ;;
        --no-build) build=0 ;;
        -*) echo "unknown option $arg" >&2; exit 2 ;;
        *) prefix="$arg" ;;
    esac
done
if [ -z "$prefix" ]; then
    echo "usage: $0 PREFIX [--debug] [--no-build]" >&2
    exit 2
fi

if [ "$build" = 1 ]; then
    if [ "$profile" = release ]; then
        cargo build -q --release -p cxlkv-ffi
    else
        cargo build -q -p cxlkv-ffi
    fi
fi

target_dir="$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
lib_dir="$target_dir/$profile"
version="$(cargo pkgid -p cxlkv-ffi | sed 's/.*[#@]//')"
major="${version%%.*}"
# What `rustc --print native-static-libs` reports for the static library on
# Linux (glibc); `pkg-config --static` links with them.
libs_private="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"

for f in "$lib_dir/libcxlkv.so" "$lib_dir/libcxlkv.a"; do
    [ -f "$f" ] || { echo "missing $f (build first, or drop --no-build)" >&2; exit 1; }
done

mkdir -p "$prefix/include" "$prefix/lib/pkgconfig"
prefix="$(cd "$prefix" && pwd)"
install -m 0644 ffi/include/cxlkv.h "$prefix/include/cxlkv.h"
install -m 0755 "$lib_dir/libcxlkv.so" "$prefix/lib/libcxlkv.so.$version"
ln -sf "libcxlkv.so.$version" "$prefix/lib/libcxlkv.so.$major"
ln -sf "libcxlkv.so.$major" "$prefix/lib/libcxlkv.so"
install -m 0644 "$lib_dir/libcxlkv.a" "$prefix/lib/libcxlkv.a"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" -e "s|@LIBS_PRIVATE@|$libs_private|" \
    ffi/cxlkv.pc.in > "$prefix/lib/pkgconfig/cxlkv.pc"
echo "installed libcxlkv $version ($profile) under $prefix"
