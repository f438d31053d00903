#!/usr/bin/env bash
# setup-hugepages.sh — reserve and release 2 MiB huge pages for cxlkv pools,
# and mount hugetlbfs.
#
#   setup-hugepages.sh reserve N [--node K] [--mount DIR | --no-mount]
#                                [--group NAME] [--lock-timeout SECS]
#   setup-hugepages.sh release [--lock-timeout SECS]
#   setup-hugepages.sh status
#
# reserve N   makes the 2 MiB pool hold at least N pages in total — host-wide,
#             or on NUMA node K with --node — and mounts hugetlbfs with 2 MiB
#             pages at DIR (default /dev/hugepages) unless it is mounted there
#             already. The pool is grown only by the shortfall, and what it
#             added is recorded, so running it twice changes nothing the
#             second time. It either gets all N pages or changes nothing (the
#             kernel may grant fewer when memory is fragmented: then the pool
#             is put back and the command fails).
# release     gives back exactly what `reserve` added (relative to the current
#             pool size, so other users' pages are untouched) and unmounts
#             what it mounted. Pages still mapped by a process stay allocated
#             (as surplus) until it unmaps them. Nothing recorded: no-op.
# status      prints the 2 MiB (and 1 GiB) pools per host and per node, the
#             hugetlbfs mounts, transparent huge page settings and the
#             reservation recorded by `reserve`.
#
# Why sysfs and not /proc/sys/vm/nr_hugepages: that file is for the *default*
# huge page size, which is 1 GiB on hosts booted with default_hugepagesz=1G;
# /sys/kernel/mm/hugepages/hugepages-2048kB/ is always the 2 MiB pool.
#
# Concurrency: every change happens under the flock on
# /tmp/cxlkv-hugepages.lock, the lock cxlkv's own tests and benches hold while
# they grow and shrink the pool (dataplane::hugepages), so neither undoes the
# other's reservation.
#
# Environment (for tests): CXLKV_SYSFS_ROOT prefixes every /sys path (a fake
# sysfs tree; the root check is skipped then), CXLKV_HUGEPAGES_STATE is the
# state file (default /run/cxlkv-hugepages.state, cleared at reboot like the
# pool itself), CXLKV_HUGEPAGES_LOCK the lock file.
#
# Exit status: 0 done (or nothing to do); 2 usage; 3 2 MiB huge pages not
# supported here; 4 not root; 5 the kernel could not provide N pages (nothing
# changed); 6 another failure (lock timeout, write or mount refused).
set -euo pipefail

readonly SYS="${CXLKV_SYSFS_ROOT:-}"
readonly STATE="${CXLKV_HUGEPAGES_STATE:-/run/cxlkv-hugepages.state}"
readonly LOCK="${CXLKV_HUGEPAGES_LOCK:-/tmp/cxlkv-hugepages.lock}"
readonly PAGE_DIR_NAME="hugepages-2048kB"
readonly GIANT_DIR_NAME="hugepages-1048576kB"
readonly DEFAULT_MOUNT="/dev/hugepages"
readonly DEFAULT_LOCK_TIMEOUT_SECS=60

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

fail() {
    local code="$1"; shift
    echo "setup-hugepages: $*" >&2
    exit "$code"
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

pool_dir() {
    local node="$1"
    if [[ -n "$node" ]]; then
        echo "$SYS/sys/devices/system/node/node$node/hugepages/$PAGE_DIR_NAME"
    else
        echo "$SYS/sys/kernel/mm/hugepages/$PAGE_DIR_NAME"
    fi
}

read_count() {
    local path="$1" value
    value="$(cat "$path" 2>/dev/null)" || fail 6 "cannot read $path"
    is_uint "$value" || fail 6 "$path holds '$value', expected a page count"
    echo "$value"
}

write_count() {
    local path="$1" value="$2"
    # The kernel may return an error (ENOMEM) for a partial grant on some
    # versions; the caller reads the value back either way.
    printf '%s' "$value" >"$path" 2>/dev/null || true
}

require_root() {
    [[ -n "$SYS" || "$(id -u)" == 0 ]] \
        || fail 4 "$1 needs root (it writes /sys/kernel/mm/hugepages and mounts hugetlbfs); run: sudo $0 $1 ..."
}

take_lock() {
    local timeout="$1"
    if ! command -v flock >/dev/null; then
        echo "setup-hugepages: WARNING: flock not found; changing the pool without the shared lock" >&2
        return
    fi
    # The lock sits in world-writable /tmp, where another user can create
    # its name first. Create it only if missing, by hard-linking a fresh
    # file of ours to the name (link(2) never follows or opens what is
    # there: a planted FIFO would block an open, a symlink redirect it);
    # then refuse anything but a regular file of ours or root's, and open it
    # read-only (flock needs no write access). In a sticky /tmp nobody else
    # can replace a file of ours or root's between the check and the open.
    # The library checks the same (dataplane/src/hugepages.rs).
    if [[ ! -e "$LOCK" && ! -L "$LOCK" ]]; then
        local fresh
        fresh="$(mktemp "$LOCK.XXXXXX")" || fail 6 "cannot create the lock file $LOCK"
        chmod 0644 "$fresh"
        ln "$fresh" "$LOCK" 2>/dev/null || true  # lost a race: checked below
        rm -f "$fresh"
    fi
    if [[ -L "$LOCK" || ! -f "$LOCK" ]]; then
        fail 6 "the huge page lock $LOCK is not a regular file (a symlink, FIFO or directory planted there?); remove it and try again"
    fi
    local owner
    owner="$(stat -c %u "$LOCK")" || fail 6 "cannot stat the lock file $LOCK"
    if [[ "$owner" != "$(id -u)" && "$owner" != 0 ]]; then
        fail 6 "the huge page lock $LOCK belongs to uid $owner, not to uid $(id -u) or root; remove it if it is stale"
    fi
    exec 9<"$LOCK" || fail 6 "cannot open the lock file $LOCK"
    flock -w "$timeout" 9 \
        || fail 6 "the huge page lock $LOCK is still held after ${timeout}s (a cxlkv test or bench is reserving pages); try again"
}

is_hugetlbfs_mount() {
    awk -v dir="$1" '$2 == dir && $3 == "hugetlbfs" { found = 1 } END { exit !found }' /proc/mounts
}

mount_options() {
    awk -v dir="$1" '$2 == dir && $3 == "hugetlbfs" { print $4; exit }' /proc/mounts
}

# Adds `added` pages for `path` to the state file (summing with an earlier
# reservation of the same pool).
record_pages() {
    local path="$1" added="$2" previous=0 tmp
    if [[ -f "$STATE" ]]; then
        previous="$(awk -v p="$path" '$1 == "pages" && $2 == p { s += $3 } END { print s + 0 }' "$STATE")"
    fi
    tmp="$(mktemp "$STATE.XXXXXX")" || fail 6 "cannot write next to the state file $STATE"
    if [[ -f "$STATE" ]]; then
        awk -v p="$path" '!($1 == "pages" && $2 == p)' "$STATE" >"$tmp"
    fi
    echo "pages $path $((previous + added))" >>"$tmp"
    mv "$tmp" "$STATE"
}

record_mount() {
    local dir="$1"
    if [[ -f "$STATE" ]] && grep -qxF "mount $dir" "$STATE"; then
        return
    fi
    echo "mount $dir" >>"$STATE"
}

cmd_reserve() {
    local pages="" node="" mount_dir="$DEFAULT_MOUNT" do_mount=1 group="" timeout="$DEFAULT_LOCK_TIMEOUT_SECS"
    [[ $# -ge 1 ]] || fail 2 "reserve needs a page count: reserve N"
    pages="$1"; shift
    { is_uint "$pages" && (( pages >= 1 )); } || fail 2 "reserve: '$pages' is not a positive page count"
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --node) [[ $# -ge 2 ]] || fail 2 "--node needs a value"; node="$2"; shift 2 ;;
            --mount) [[ $# -ge 2 ]] || fail 2 "--mount needs a directory"; mount_dir="$2"; shift 2 ;;
            --no-mount) do_mount=0; shift ;;
            --group) [[ $# -ge 2 ]] || fail 2 "--group needs a group name"; group="$2"; shift 2 ;;
            --lock-timeout) [[ $# -ge 2 ]] || fail 2 "--lock-timeout needs seconds"; timeout="$2"; shift 2 ;;
            *) fail 2 "reserve: unknown option $1" ;;
        esac
    done
    [[ -z "$node" ]] || is_uint "$node" || fail 2 "--node takes a node number, got '$node'"
    is_uint "$timeout" || fail 2 "--lock-timeout takes seconds, got '$timeout'"
    [[ "$mount_dir" == /* ]] || fail 2 "--mount takes an absolute directory, got '$mount_dir'"
    if [[ -n "$group" ]]; then
        getent group "$group" >/dev/null || fail 2 "--group: no group named '$group' (create it first, e.g. systemd-sysusers deploy/sysusers.d/cxlkv.conf)"
    fi

    local dir path scope
    dir="$(pool_dir "$node")"
    path="$dir/nr_hugepages"
    scope="${node:+NUMA node $node}"; scope="${scope:-the host}"
    [[ -f "$path" ]] || fail 3 "2 MiB huge pages are not available on ${scope}: $path does not exist"
    require_root reserve

    take_lock "$timeout"
    local before after
    before="$(read_count "$path")"
    if (( before >= pages )); then
        echo "setup-hugepages: ${scope} already has $before 2 MiB pages (asked for $pages); pool unchanged"
    else
        write_count "$path" "$pages"
        after="$(read_count "$path")"
        if (( after < pages )); then
            write_count "$path" "$before"
            fail 5 "asked for $pages 2 MiB pages on ${scope}, the kernel could provide only $after (memory too fragmented or too little free); put the pool back to $before. Reserve early after boot, or at boot with hugepages=$pages on the kernel command line, or compact first: echo 1 > /proc/sys/vm/compact_memory"
        fi
        record_pages "$path" "$((after - before))"
        echo "setup-hugepages: ${scope}: 2 MiB pages $before -> $after (free now: $(read_count "$dir/free_hugepages"))"
    fi

    (( do_mount )) || return 0
    if is_hugetlbfs_mount "$mount_dir"; then
        local opts
        opts="$(mount_options "$mount_dir")"
        echo "setup-hugepages: hugetlbfs already mounted at $mount_dir ($opts)"
        if [[ "$opts" != *pagesize=2M* ]] && [[ "$(awk '/^Hugepagesize:/ { print $2 }' /proc/meminfo)" != 2048 ]]; then
            echo "setup-hugepages: WARNING: $mount_dir uses the default huge page size, which is not 2 MiB here; mount one with -o pagesize=2M (--mount DIR)" >&2
        fi
        return 0
    fi
    if mountpoint -q "$mount_dir" 2>/dev/null; then
        fail 6 "$mount_dir is a mount point but not hugetlbfs; choose another --mount"
    fi
    local options="pagesize=2M"
    if [[ -n "$group" ]]; then
        options="$options,gid=$(getent group "$group" | cut -d: -f3),mode=1770"
    fi
    mkdir -p "$mount_dir" || fail 6 "cannot create $mount_dir"
    mount -t hugetlbfs -o "$options" none "$mount_dir" \
        || fail 6 "mount -t hugetlbfs -o $options none $mount_dir failed"
    record_mount "$mount_dir"
    echo "setup-hugepages: mounted hugetlbfs at $mount_dir ($options)"
    if [[ -z "$group" ]]; then
        echo "setup-hugepages: note: only root can create files there; remount with --group cxlkv for the service user"
    fi
}

cmd_release() {
    local timeout="$DEFAULT_LOCK_TIMEOUT_SECS"
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --lock-timeout) [[ $# -ge 2 ]] || fail 2 "--lock-timeout needs seconds"; timeout="$2"; shift 2 ;;
            *) fail 2 "release: unknown option $1 (release gives back what reserve recorded in $STATE)" ;;
        esac
    done
    is_uint "$timeout" || fail 2 "--lock-timeout takes seconds, got '$timeout'"
    if [[ ! -s "$STATE" ]]; then
        echo "setup-hugepages: nothing to release (no reservation recorded in $STATE)"
        return 0
    fi
    require_root release
    take_lock "$timeout"

    local kind arg count remaining="" status=0 now target after
    while read -r kind arg count; do
        case "$kind" in
            pages)
                if [[ ! -f "$arg" ]]; then
                    echo "setup-hugepages: $arg is gone; dropping its record" >&2
                    continue
                fi
                now="$(read_count "$arg")"
                target=$(( now > count ? now - count : 0 ))
                write_count "$arg" "$target"
                after="$(read_count "$arg")"
                echo "setup-hugepages: ${arg%/nr_hugepages}: 2 MiB pages $now -> $after (gave back $count)"
                if (( after > target )); then
                    echo "setup-hugepages: note: $((after - target)) page(s) are still in use and are freed when their users unmap them" >&2
                fi
                ;;
            mount)
                if ! is_hugetlbfs_mount "$arg"; then
                    echo "setup-hugepages: $arg is no longer a hugetlbfs mount"
                elif umount "$arg" 2>/dev/null; then
                    echo "setup-hugepages: unmounted $arg"
                else
                    echo "setup-hugepages: cannot unmount $arg (busy: a process has files there open or mapped); kept in $STATE, run release again later" >&2
                    remaining+="mount $arg"$'\n'
                    status=6
                fi
                ;;
            *) ;;
        esac
    done <"$STATE"
    if [[ -n "$remaining" ]]; then
        printf '%s' "$remaining" >"$STATE"
    else
        rm -f "$STATE"
    fi
    return "$status"
}

print_pool_row() {
    local label="$1" dir="$2" f v row
    row="$(printf '  %-12s' "$label")"
    for f in nr_hugepages free_hugepages resv_hugepages surplus_hugepages; do
        if [[ -r "$dir/$f" ]]; then v="$(cat "$dir/$f")"; else v="-"; fi
        row+="$(printf ' %9s' "$v")"
    done
    echo "$row"
}

cmd_status() {
    [[ $# -eq 0 ]] || fail 2 "status takes no options"
    local size_dir node_dir node
    for size_dir in "$PAGE_DIR_NAME" "$GIANT_DIR_NAME"; do
        local label="2 MiB"
        [[ "$size_dir" == "$GIANT_DIR_NAME" ]] && label="1 GiB"
        if [[ ! -d "$SYS/sys/kernel/mm/hugepages/$size_dir" ]]; then
            echo "$label huge pages: not supported by this kernel ($SYS/sys/kernel/mm/hugepages/$size_dir missing)"
            continue
        fi
        echo "$label huge pages ($size_dir):"
        printf '  %-12s %9s %9s %9s %9s\n' "" total free reserved surplus
        print_pool_row "host" "$SYS/sys/kernel/mm/hugepages/$size_dir"
        for node_dir in "$SYS"/sys/devices/system/node/node[0-9]*; do
            [[ -d "$node_dir/hugepages/$size_dir" ]] || continue
            node="${node_dir##*/}"
            print_pool_row "$node" "$node_dir/hugepages/$size_dir"
        done
    done
    echo "default huge page size: $(awk '/^Hugepagesize:/ { print $2 " " $3 }' /proc/meminfo 2>/dev/null || echo unknown)"
    echo "hugetlbfs mounts:"
    if ! awk '$3 == "hugetlbfs" { print "  " $2 " (" $4 ")"; n++ } END { exit !n }' /proc/mounts; then
        echo "  none"
    fi
    local thp="$SYS/sys/kernel/mm/transparent_hugepage"
    if [[ -r "$thp/enabled" ]]; then
        echo "transparent huge pages: enabled: $(cat "$thp/enabled"); shmem_enabled: $(cat "$thp/shmem_enabled" 2>/dev/null || echo n/a); defrag: $(cat "$thp/defrag" 2>/dev/null || echo n/a)"
    else
        echo "transparent huge pages: not supported"
    fi
    if [[ -s "$STATE" ]]; then
        echo "recorded by reserve ($STATE):"
        sed 's/^/  /' "$STATE"
    else
        echo "recorded by reserve: nothing ($STATE absent)"
    fi
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
command="$1"; shift
case "$command" in
    reserve) cmd_reserve "$@" ;;
    release) cmd_release "$@" ;;
    status) cmd_status "$@" ;;
    -h|--help|help) usage ;;
    *) fail 2 "unknown command '$command' (reserve N | release | status)" ;;
esac
