#!/usr/bin/env bash
# hwbench.sh — the cxlkv hardware benchmark suite.
#
# Runs every `cxlkv bench` scenario (discovered from `cxlkv bench --list`)
# against one pool — a device-DAX node such as /dev/dax0.0, a file on
# hugetlbfs or tmpfs, or the embedded default (a temporary /dev/shm file) —
# optionally pinned to a NUMA node, and writes a self-contained results
# directory:
#
#   run-info.txt          what was run, where, with which options
#   machine/              lscpu, numactl -H, kernel, meminfo, THP, huge pages,
#                         device DAX (sysfs, daxctl/ndctl/cxl list), cpufreq
#   scenarios/NAME.jsonl  each scenario's JSON Lines (bench contract, docs/benchmarks.md)
#   scenarios/NAME.stderr its notes and errors
#   runs.tsv              scenario, exit status, seconds, timed out
#   results.jsonl         every valid record of every scenario
#   run.json              run-info + per-scenario status, for machines
#   summary.md            status per scenario, a results table, missed targets,
#                         unstable targets (reps too far apart to call them
#                         met), targets no case was checked against
#   plots/*.svg           ours vs baseline and ratio per case, per scenario,
#                         and every ratio of the run in plots/ratios.svg
#   cleanup.txt           (when needed) processes a scenario left running and
#                         files it left behind, stopped and removed by hwbench
#
# Each scenario runs in a process group of its own: its time limit, Ctrl-C
# and a check after it ends reach every process it started (a forked or
# spawned server), and the cxlkv-* files named after its pid that appeared
# in /dev/shm or $TMPDIR while it ran are removed when it could not remove
# them itself (it was stopped by a signal).
#
# The report (results.jsonl, run.json, summary.md, plots) is made by
# scripts/bench_report.py (Python 3 standard library only); targets come from
# scripts/bench-targets.tsv. Re-run the report alone with
#   scripts/bench_report.py RESULTS_DIR
#
# Threads and chunk sizes reach scenarios through the environment:
#   CXLKV_BENCH_THREADS=N             (--threads N): taken by alloc (cases
#                                     threads=1 and threads=N) and pool (N
#                                     clients in its multi-client cases)
#   CXLKV_BENCH_CHUNK_SIZES=LIST      (--chunk-sizes LIST, e.g. 64KiB,1MiB,32MiB):
#                                     taken by copy (its sizes) and store (one
#                                     case per size)
# and, when `cxlkv bench --help` declares the flag, also as `--threads N` /
# `--chunk-sizes LIST` on the command line (cxlkv declares both since
# 2026-12-01; older binaries read only the variables). A scenario that takes
# one echoes the value in its records (`threads`, `chunk_bytes`) and refuses
# a malformed one; the others ignore them (a flag with a note on stderr).
# run-info.txt says which of the chosen scenarios took them, and a warning
# is printed when none did. (Contract for scenario authors: list a scenario
# that reads one in THREADS_TAKEN_BY / CHUNKS_TAKEN_BY below and in
# bench::THREADS_TAKEN_BY / CHUNK_SIZES_TAKEN_BY (a unit test compares
# them), and echo the values used as record fields `threads` /
# `chunk_bytes`.)
#
# --pool. Every scenario that starts a server or maps a pool measures on it
# (each record's `pool` and `dest` fields say so); alloc and directory-memory
# keep their state in process memory and report pool "none". WARNING: scenarios
# write into the pool — copy overwrites its first bytes, and before each server
# starts its header block is zeroed so that a fresh pool manager takes it. A
# pool that a pool manager on this host is serving is refused; never point
# --pool at a device that holds a live cxlkv pool or anyone's data.
#
# Needs bash >= 4.4 and python3 (standard library only).
#
# Exit status: 0 every scenario ran and reported; 1 at least one scenario
# failed, timed out or broke the bench contract (the report says which);
# 2 usage error; 3 setup failed (no python3, build failed, numactl refused
# the binding, output directory not writable); 130 interrupted (the report is
# still written for what ran).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
readonly SCRIPT_DIR REPO_ROOT

# Scenarios that read CXLKV_BENCH_THREADS / CXLKV_BENCH_CHUNK_SIZES
# (src/bench/mod.rs); kept in step with the scenarios' module docs.
readonly THREADS_TAKEN_BY="alloc pool"
readonly CHUNKS_TAKEN_BY="copy store"

# Per-scenario wall-clock limits: a hung scenario must not stall the suite.
readonly DEFAULT_TIMEOUT_SECS=3600
readonly DEFAULT_QUICK_TIMEOUT_SECS=600
# Grace between SIGTERM and SIGKILL once a scenario's limit is reached.
readonly KILL_AFTER_SECS=15

usage() {
    cat <<'EOF'
Usage: scripts/hwbench.sh [options]

Runs every `cxlkv bench` scenario with --json and writes a results directory
(JSON Lines, summary.md, SVG plots, machine info).

Options:
  --pool PATH          pool to measure on: /dev/daxX.Y, or a file on hugetlbfs,
                       tmpfs or a DAX filesystem (default: $CXLKV_BENCH_POOL if
                       set, else the embedded default, a temporary /dev/shm
                       file). Scenarios WRITE into it.
  --numa-node N        run on the CPUs of NUMA node N and allocate from node N
                       (numactl --cpunodebind=N --membind=N; numactl required
                       for pinning: without it the run is NOT pinned and the
                       report says so)
  --mem-node M         allocate from node M instead of N (e.g. a CPU-less
                       CXL memory node); default: the --numa-node
  --threads N          threads, for the scenarios that take them (alloc,
                       pool); the others ignore it
  --chunk-sizes LIST   chunk sizes, comma-separated, e.g. 64KiB,1MiB,32MiB,
                       for the scenarios that take them (copy, store); the
                       others ignore it
  --reps N             repetitions per case (default: each scenario's own)
  --quick              CI-sized run (seconds per scenario)
  --scenarios a,b,c    run only these scenarios (default: all listed)
  --out DIR            results directory
                       (default: bench-results/<UTC timestamp>-<host>)
  --binary PATH        use this cxlkv binary instead of building
                       target/release/cxlkv (env CXLKV_BIN)
  --timeout SECS       wall-clock limit per scenario, after which it is
                       stopped with every process it started
                       (default 3600, or 600 with --quick)
  -h, --help           this help

Exit status: 0 all scenarios ok; 1 some scenario failed; 2 usage;
3 setup failed; 130 interrupted.
EOF
}

die_usage() {
    echo "hwbench: $*" >&2
    echo "hwbench: see scripts/hwbench.sh --help" >&2
    exit 2
}

die_setup() {
    echo "hwbench: $*" >&2
    exit 3
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# --- options -----------------------------------------------------------------

POOL="${CXLKV_BENCH_POOL:-}"
NUMA_NODE=""
MEM_NODE=""
THREADS=""
CHUNK_SIZES=""
REPS=""
QUICK=0
SCENARIO_LIST=""
OUT=""
BINARY="${CXLKV_BIN:-}"
TIMEOUT_SECS=""
ORIGINAL_ARGS=("$@")

need_value() {
    [[ $# -ge 2 && -n "$2" ]] || die_usage "$1 needs a value"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --pool) need_value "$@"; POOL="$2"; shift 2 ;;
        --numa-node) need_value "$@"; NUMA_NODE="$2"; shift 2 ;;
        --mem-node) need_value "$@"; MEM_NODE="$2"; shift 2 ;;
        --threads) need_value "$@"; THREADS="$2"; shift 2 ;;
        --chunk-sizes) need_value "$@"; CHUNK_SIZES="$2"; shift 2 ;;
        --reps) need_value "$@"; REPS="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --scenarios) need_value "$@"; SCENARIO_LIST="$2"; shift 2 ;;
        --out) need_value "$@"; OUT="$2"; shift 2 ;;
        --binary) need_value "$@"; BINARY="$2"; shift 2 ;;
        --timeout) need_value "$@"; TIMEOUT_SECS="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die_usage "unknown option: $1" ;;
    esac
done

[[ -z "$NUMA_NODE" ]] || is_uint "$NUMA_NODE" || die_usage "--numa-node takes a node number, got '$NUMA_NODE'"
[[ -z "$MEM_NODE" ]] || is_uint "$MEM_NODE" || die_usage "--mem-node takes a node number, got '$MEM_NODE'"
[[ -z "$MEM_NODE" || -n "$NUMA_NODE" ]] || die_usage "--mem-node needs --numa-node (the CPU node)"
[[ -z "$THREADS" ]] || { is_uint "$THREADS" && (( THREADS >= 1 )); } || die_usage "--threads takes a positive integer, got '$THREADS'"
[[ -z "$REPS" ]] || { is_uint "$REPS" && (( REPS >= 1 )); } || die_usage "--reps takes a positive integer, got '$REPS'"
[[ -z "$TIMEOUT_SECS" ]] || { is_uint "$TIMEOUT_SECS" && (( TIMEOUT_SECS >= 1 )); } || die_usage "--timeout takes a positive number of seconds, got '$TIMEOUT_SECS'"
if [[ -n "$CHUNK_SIZES" ]]; then
    IFS=',' read -r -a chunk_items <<<"$CHUNK_SIZES"
    for item in "${chunk_items[@]}"; do
        [[ "$item" =~ ^[0-9]+(B|KiB|MiB|GiB)?$ ]] \
            || die_usage "--chunk-sizes: '$item' is not a size like 4096, 64KiB, 1MiB or 1GiB"
    done
fi
for node in $NUMA_NODE $MEM_NODE; do
    [[ -d "/sys/devices/system/node/node$node" ]] \
        || die_usage "NUMA node $node does not exist (nodes: $(cd /sys/devices/system/node && echo node[0-9]*))"
done
if [[ -n "$POOL" ]]; then
    [[ -e "$POOL" ]] || die_usage "pool '$POOL' does not exist (a file pool must be created first, e.g. truncate -s 8G /dev/hugepages/cxlkv-bench)"
    [[ -r "$POOL" && -w "$POOL" ]] || die_usage "pool '$POOL' is not readable and writable by $(id -un)"
fi
if [[ -z "$TIMEOUT_SECS" ]]; then
    if (( QUICK )); then TIMEOUT_SECS=$DEFAULT_QUICK_TIMEOUT_SECS; else TIMEOUT_SECS=$DEFAULT_TIMEOUT_SECS; fi
fi

# --- prerequisites -----------------------------------------------------------

command -v python3 >/dev/null \
    || die_setup "python3 is required for the report (summary.md, plots); install it (Debian: apt-get install python3) — checked before running anything"

if [[ -z "$BINARY" ]]; then
    command -v cargo >/dev/null \
        || die_setup "cargo not found: install Rust, or pass --binary PATH to a built cxlkv"
    echo "hwbench: building the release binary (cargo build --release --bin cxlkv)" >&2
    (cd "$REPO_ROOT" && cargo build --release --bin cxlkv) \
        || die_setup "cargo build --release failed"
    BINARY="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/cxlkv"
fi
[[ -x "$BINARY" ]] || die_setup "cxlkv binary '$BINARY' is missing or not executable"

# Scenario names from the binary itself: the first word of each --list line.
list_output="$("$BINARY" bench --list)" || die_setup "'$BINARY bench --list' failed"
ALL_SCENARIOS=()
while read -r name _; do
    [[ -n "$name" ]] || continue
    [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_-]*$ ]] \
        || die_setup "'cxlkv bench --list' printed an unexpected scenario name '$name'"
    ALL_SCENARIOS+=("$name")
done <<<"$list_output"
(( ${#ALL_SCENARIOS[@]} > 0 )) || die_setup "'cxlkv bench --list' lists no scenarios"

SCENARIOS=()
if [[ -n "$SCENARIO_LIST" ]]; then
    IFS=',' read -r -a wanted <<<"$SCENARIO_LIST"
    for name in "${wanted[@]}"; do
        found=0
        for known in "${ALL_SCENARIOS[@]}"; do
            [[ "$name" == "$known" ]] && found=1
        done
        (( found )) || die_usage "unknown scenario '$name'; this cxlkv has: ${ALL_SCENARIOS[*]}"
        SCENARIOS+=("$name")
    done
else
    SCENARIOS=("${ALL_SCENARIOS[@]}")
fi

# Which of the chosen scenarios take a setting ("a b"), or "" for none.
takers() {
    local taken_by="$1" name out=""
    for name in "${SCENARIOS[@]}"; do
        [[ " $taken_by " == *" $name "* ]] && out+="${out:+ }$name"
    done
    printf '%s' "$out"
}

# Which optional flags this cxlkv declares; the environment carries them
# either way.
bench_help="$("$BINARY" bench --help 2>&1 || true)"
declares_flag() { grep -q -- "$1[ =<]" <<<"$bench_help"; }
THREADS_VIA=""
CHUNKS_VIA=""
EXTRA_FLAGS=()
if [[ -n "$THREADS" ]]; then
    export CXLKV_BENCH_THREADS="$THREADS"
    if declares_flag --threads; then
        EXTRA_FLAGS+=(--threads "$THREADS"); THREADS_VIA="passed as --threads and CXLKV_BENCH_THREADS"
    else
        THREADS_VIA="passed as CXLKV_BENCH_THREADS"
    fi
    taken="$(takers "$THREADS_TAKEN_BY")"
    if [[ -n "$taken" ]]; then
        THREADS_VIA+="; taken by: $taken (the other scenarios ignore it)"
    else
        THREADS_VIA+="; IGNORED: none of the chosen scenarios takes it (only: $THREADS_TAKEN_BY)"
        echo "hwbench: WARNING: --threads is ignored: none of the chosen scenarios takes it (only: $THREADS_TAKEN_BY)" >&2
    fi
fi
if [[ -n "$CHUNK_SIZES" ]]; then
    export CXLKV_BENCH_CHUNK_SIZES="$CHUNK_SIZES"
    if declares_flag --chunk-sizes; then
        EXTRA_FLAGS+=(--chunk-sizes "$CHUNK_SIZES"); CHUNKS_VIA="passed as --chunk-sizes and CXLKV_BENCH_CHUNK_SIZES"
    else
        CHUNKS_VIA="passed as CXLKV_BENCH_CHUNK_SIZES"
    fi
    taken="$(takers "$CHUNKS_TAKEN_BY")"
    if [[ -n "$taken" ]]; then
        CHUNKS_VIA+="; taken by: $taken (the other scenarios ignore it)"
    else
        CHUNKS_VIA+="; IGNORED: none of the chosen scenarios takes it (only: $CHUNKS_TAKEN_BY)"
        echo "hwbench: WARNING: --chunk-sizes is ignored: none of the chosen scenarios takes it (only: $CHUNKS_TAKEN_BY)" >&2
    fi
fi

# NUMA pinning.
PIN=()
PINNING="not requested"
if [[ -n "$NUMA_NODE" ]]; then
    mem_node="${MEM_NODE:-$NUMA_NODE}"
    if command -v numactl >/dev/null; then
        PIN=(numactl "--cpunodebind=$NUMA_NODE" "--membind=$mem_node")
        "${PIN[@]}" true 2>/dev/null \
            || die_setup "'${PIN[*]} true' failed: node $NUMA_NODE may have no CPUs (a CXL memory node has none: use --numa-node <cpu node> --mem-node $NUMA_NODE)"
        PINNING="${PIN[*]}"
    else
        PINNING="NOT PINNED: numactl not found (asked for CPU node $NUMA_NODE, memory node $mem_node; Debian: apt-get install numactl)"
        echo "hwbench: WARNING: numactl not found — the run is NOT pinned to NUMA node $NUMA_NODE" >&2
    fi
fi

if [[ -n "$POOL" ]]; then
    echo "hwbench: WARNING: scenarios write into $POOL (and zero its header block); it must not hold a live pool or data" >&2
fi

# --- results directory -------------------------------------------------------

HOST="$(hostname -s 2>/dev/null || uname -n)"
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
if [[ -z "$OUT" ]]; then
    OUT="$REPO_ROOT/bench-results/$(date -u +%Y%m%dT%H%M%SZ)-$HOST"
fi
mkdir -p "$OUT/machine" "$OUT/scenarios" "$OUT/plots" \
    || die_setup "cannot create the results directory '$OUT'"
[[ -z "$(ls -A "$OUT/scenarios")" ]] \
    || die_setup "'$OUT' already holds scenario results; choose another --out"

# Machine information: each file holds a command's output, or why it is missing.
capture() {
    local file="$1"; shift
    if command -v "$1" >/dev/null; then
        "$@" >"$OUT/machine/$file" 2>&1 || echo "(exit status $? from: $*)" >>"$OUT/machine/$file"
    else
        echo "not available: $1 not found" >"$OUT/machine/$file"
    fi
}
dump_files() {
    local file="$1"; shift
    local f
    for f in "$@"; do
        [[ -r "$f" ]] && printf '%s: %s\n' "$f" "$(tr '\n' ' ' <"$f")"
    done >"$OUT/machine/$file" 2>/dev/null || true
}
capture lscpu.txt lscpu
capture numactl-H.txt numactl -H
capture uname.txt uname -a
capture daxctl-list.json daxctl list -R -D -M
capture ndctl-list.json ndctl list -N -R
capture cxl-list.json cxl list -M -R -D
cp /etc/os-release "$OUT/machine/os-release.txt" 2>/dev/null || echo "not available" >"$OUT/machine/os-release.txt"
cp /proc/meminfo "$OUT/machine/meminfo.txt"
cp /proc/cmdline "$OUT/machine/kernel-cmdline.txt" 2>/dev/null || true
dump_files thp.txt /sys/kernel/mm/transparent_hugepage/enabled \
    /sys/kernel/mm/transparent_hugepage/defrag \
    /sys/kernel/mm/transparent_hugepage/shmem_enabled
"$SCRIPT_DIR/setup-hugepages.sh" status >"$OUT/machine/hugepages.txt" 2>&1 || true
dump_files cpufreq.txt /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor
if [[ -d /sys/bus/dax/devices ]]; then
    dump_files dax-sysfs.txt /sys/bus/dax/devices/*/size /sys/bus/dax/devices/*/align \
        /sys/bus/dax/devices/*/target_node /sys/bus/dax/devices/*/numa_node \
        /sys/bus/dax/devices/*/modalias
    [[ -s "$OUT/machine/dax-sysfs.txt" ]] || echo "/sys/bus/dax present; no dax devices" >"$OUT/machine/dax-sysfs.txt"
else
    echo "not available: no /sys/bus/dax (no device DAX support loaded)" >"$OUT/machine/dax-sysfs.txt"
fi
printf '%s\n' "$bench_help" >"$OUT/machine/bench-help.txt"

GIT_COMMIT="unknown"
if command -v git >/dev/null && git -C "$REPO_ROOT" rev-parse HEAD >/dev/null 2>&1; then
    GIT_COMMIT="$(git -C "$REPO_ROOT" rev-parse HEAD)"
    [[ -z "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]] \
        || GIT_COMMIT="$GIT_COMMIT (with uncommitted changes)"
fi

write_run_info() {
    {
        echo "command: scripts/hwbench.sh ${ORIGINAL_ARGS[*]}"
        echo "host: $HOST"
        echo "started: $STARTED"
        echo "finished: ${FINISHED:-}"
        echo "commit: $GIT_COMMIT"
        echo "binary: $BINARY"
        echo "binary version: $("$BINARY" --version 2>/dev/null || echo unknown)"
        echo "pool: ${POOL:-embedded default (temporary file under /dev/shm)}"
        echo "pinning: $PINNING"
        echo "threads: ${THREADS:-scenario default}${THREADS_VIA:+ — $THREADS_VIA}"
        echo "chunk sizes: ${CHUNK_SIZES:-scenario default}${CHUNKS_VIA:+ — $CHUNKS_VIA}"
        echo "reps: ${REPS:-scenario default}"
        echo "quick: $([[ $QUICK == 1 ]] && echo yes || echo no)"
        echo "timeout per scenario: ${TIMEOUT_SECS}s"
        echo "scenarios: ${SCENARIOS[*]}"
        echo "interrupted: $([[ $INTERRUPTED == 1 ]] && echo yes || echo no)"
    } >"$OUT/run-info.txt"
}

# --- run ---------------------------------------------------------------------

INTERRUPTED=0
# The running scenario's process group, while there is one, and whether an
# interrupt was passed on to it.
SCENARIO_GROUP=""
FORWARDED=0
# Ctrl-C (or SIGTERM) reaches only this script: pass it on to the running
# scenario's group from the trap itself, so that it is passed on wherever
# it lands — in `wait`, or between two commands (on a loaded host the
# script can be anywhere when the signal comes; a check only after `wait`
# returned missed one that came before `wait` began, and then waited for
# the scenario to end by itself).
forward_interrupt() {
    if [[ -n "$SCENARIO_GROUP" ]] && (( ! FORWARDED )); then
        kill -INT -- "-$SCENARIO_GROUP" 2>/dev/null || true
        FORWARDED=1
    fi
}
trap 'INTERRUPTED=1; forward_interrupt' INT TERM

COMMON_FLAGS=(--json)
[[ -n "$POOL" ]] && COMMON_FLAGS+=(--pool "$POOL")
[[ -n "$REPS" ]] && COMMON_FLAGS+=(--reps "$REPS")
(( QUICK )) && COMMON_FLAGS+=(--quick)

# Each scenario runs in a process group of its own (job control, `set -m`
# around its start), so that its time limit, an interrupt and the clean-up
# after it reach every process it started — a server it forked or spawned
# included — and nothing else. timeout(1) without --foreground signals that
# whole group when the limit passes; Ctrl-C reaches only this script (the
# terminal's foreground group), which passes it on to the scenario's group.
RUNNER=()
if command -v timeout >/dev/null; then
    RUNNER=(timeout "--kill-after=$KILL_AFTER_SECS" "$TIMEOUT_SECS")
else
    echo "hwbench: WARNING: coreutils 'timeout' not found; scenarios run without a time limit" >&2
fi
# Grace between SIGTERM and SIGKILL for processes a scenario left behind.
readonly LEFTOVER_GRACE_SECS=5
PID_DIR="$(mktemp -d "${TMPDIR:-/tmp}/hwbench-pids.XXXXXX")" \
    || die_setup "cannot create a temporary directory"
trap 'rm -rf "$PID_DIR"' EXIT

# Entries of /dev/shm and $TMPDIR that a cxlkv process names after its pid
# (`cxlkv-<tag>-<pid>-…` pools, state directories and sockets).
cxlkv_entries() {
    local dir
    for dir in /dev/shm "${TMPDIR:-/tmp}"; do
        [[ -d "$dir" ]] || continue
        find "$dir" -mindepth 1 -maxdepth 1 -name 'cxlkv-*' -print 2>/dev/null || true
    done | sort
}

# After scenario $1 (process group $2, the bench's pid in $3, entries that
# existed before it in $4): stop every process left in its group, and remove
# the new cxlkv-* entries named after the bench's or a stopped process's pid
# (a bench stopped by a signal runs no destructors). Says what it did on
# stderr and in cleanup.txt.
clean_up_after() {
    local name="$1" group="$2" bench_pid="$3" before="$4"
    local pids=("$bench_pid") left=() entry pid waited=0 removed=()
    if kill -0 -- "-$group" 2>/dev/null; then
        if command -v pgrep >/dev/null; then
            read -r -a left <<<"$(pgrep -g "$group" -d ' ' || true)"
        fi
        pids+=("${left[@]}")
        kill -TERM -- "-$group" 2>/dev/null || true
        while kill -0 -- "-$group" 2>/dev/null && (( waited < LEFTOVER_GRACE_SECS * 10 )); do
            sleep 0.1
            waited=$((waited + 1))
        done
        kill -KILL -- "-$group" 2>/dev/null || true
        echo "hwbench: $name left process(es) running after it ended (pids: ${left[*]:-unknown}); stopped them" \
            | tee -a "$OUT/cleanup.txt" >&2
    fi
    while read -r entry; do
        [[ -n "$entry" ]] || continue
        grep -qxF -- "$entry" <<<"$before" && continue
        for pid in "${pids[@]}"; do
            [[ -n "$pid" ]] || continue
            if [[ "$(basename -- "$entry")" =~ ^cxlkv-.*-${pid}([-.]|$) ]]; then
                rm -rf -- "$entry" && removed+=("$entry")
                break
            fi
        done
    done <<<"$(cxlkv_entries)"
    if (( ${#removed[@]} > 0 )); then
        echo "hwbench: $name left files behind; removed: ${removed[*]}" | tee -a "$OUT/cleanup.txt" >&2
    fi
}

write_run_info
printf 'scenario\texit\tseconds\ttimed_out\n' >"$OUT/runs.tsv"
echo "hwbench: ${#SCENARIOS[@]} scenario(s) -> $OUT" >&2
index=0
for name in "${SCENARIOS[@]}"; do
    index=$((index + 1))
    if (( INTERRUPTED )); then
        break
    fi
    cmd=("${PIN[@]}" "$BINARY" bench "$name" "${COMMON_FLAGS[@]}" "${EXTRA_FLAGS[@]}")
    printf 'hwbench: [%d/%d] %s ... ' "$index" "${#SCENARIOS[@]}" "$name" >&2
    start_ns="$(date +%s%N)"
    entries_before="$(cxlkv_entries)"
    pid_file="$PID_DIR/$name.pid"
    : >"$pid_file"
    set -m
    "${RUNNER[@]}" bash -c 'echo $$ >"$0"; exec "$@"' "$pid_file" "${cmd[@]}" \
        >"$OUT/scenarios/$name.jsonl" 2>"$OUT/scenarios/$name.stderr" </dev/null &
    group=$!
    set +m
    FORWARDED=0
    SCENARIO_GROUP="$group"
    # An interrupt that came before the group was known.
    if (( INTERRUPTED )); then
        forward_interrupt
    fi
    while :; do
        set +e
        wait "$group"
        status=$?
        set -e
        # `wait` returns early when a trapped signal arrives (the trap has
        # passed it on): wait on until the scenario ends.
        kill -0 "$group" 2>/dev/null || break
    done
    SCENARIO_GROUP=""
    # A signal that arrived as the scenario ended: its own status, if bash
    # still holds it.
    if (( status > 128 )); then
        set +e
        wait "$group" 2>/dev/null
        reaped=$?
        set -e
        (( reaped == 127 )) || status=$reaped
    fi
    # A scenario that ends with SIGINT's status was interrupted with us.
    # Bash runs our trap only if its child *died* of the signal; a child
    # that caught it and exited 130 (a shell between two commands, or
    # timeout(1) reporting its child's death) would otherwise let the run
    # go on to the next scenario.
    if (( status == 130 )); then
        INTERRUPTED=1
    fi
    end_ns="$(date +%s%N)"
    seconds="$(( (end_ns - start_ns) / 1000000 ))"
    seconds="$((seconds / 1000)).$(printf '%03d' $((seconds % 1000)))"
    timed_out=0
    # timeout(1) exits 124 on expiry, or 128+9 when it had to SIGKILL.
    if (( ${#RUNNER[@]} > 0 )) && (( status == 124 || status == 137 )); then
        timed_out=1
    fi
    printf '%s\t%d\t%s\t%d\n' "$name" "$status" "$seconds" "$timed_out" >>"$OUT/runs.tsv"
    records="$(grep -c . "$OUT/scenarios/$name.jsonl" || true)"
    if (( timed_out )); then
        echo "TIMED OUT after ${TIMEOUT_SECS}s" >&2
    elif (( status != 0 )); then
        echo "FAILED (exit $status, ${seconds}s)" >&2
        tail -n 5 "$OUT/scenarios/$name.stderr" | sed 's/^/hwbench:     /' >&2
    else
        echo "done (${records} line(s), ${seconds}s)" >&2
    fi
    clean_up_after "$name" "$group" "$(cat "$pid_file")" "$entries_before"
done

FINISHED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
write_run_info

set +e
python3 "$SCRIPT_DIR/bench_report.py" "$OUT" --targets "$SCRIPT_DIR/bench-targets.tsv"
report_status=$?
set -e

if (( INTERRUPTED )); then
    echo "hwbench: interrupted; partial results in $OUT" >&2
    exit 130
fi
case "$report_status" in
    0) echo "hwbench: all scenarios ok; see $OUT/summary.md" >&2; exit 0 ;;
    1) echo "hwbench: some scenarios failed; see $OUT/summary.md" >&2; exit 1 ;;
    *) die_setup "the report could not be written (bench_report.py exit $report_status)" ;;
esac
