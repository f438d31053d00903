#!/usr/bin/env bash
# profile.sh — profile a cxlkv bench scenario (or any cxlkv subcommand) with
# perf, and draw a flame graph.
#
#   scripts/profile.sh [options] SCENARIO          # cxlkv bench SCENARIO --json
#   scripts/profile.sh [options] -- SUBCOMMAND...  # e.g. -- demo --instances 4
#
# Writes into the output directory:
#   command.txt       the profiled command line, perf version, event, mode
#   perf-stat.txt     `perf stat` of one run (hardware counters where the
#                     machine has them; software counters otherwise)
#   perf.data         the `perf record` samples
#   perf-report.txt   `perf report --stdio`: call graphs of the hot symbols
#   perf-top.txt      flat profile: self time per symbol
#   stacks.folded     collapsed stacks (inferno-collapse-perf)
#   flamegraph.svg    the flame graph (inferno-flamegraph)
#   output.txt        the profiled command's stdout
#   stat-output.txt   the command's stdout and stderr during the perf stat run
#   perf-record.log   perf record's messages and the command's stderr
#   summary.txt       what ran, counters available or not, the top symbols
#
# Call graphs: `--call-graph dwarf` by default. Rust's standard library and
# libc are built without frame pointers, so frame-pointer unwinding (`fp`)
# loses every frame that passes through them, unless the binary is also
# built with -C force-frame-pointers=yes (done for you with --call-graph fp,
# into target/frame-pointers; std itself still has none). dwarf copies 16 KiB
# of stack per sample and unwinds offline with the binary's .eh_frame and its
# line tables (release builds keep `debug = "line-tables-only"`), which gives
# whole stacks including inlined frames, at the price of a larger perf.data and
# more overhead per sample: keep the frequency moderate (default 499 Hz).
#
# Event: `cycles` where the CPU's counters are usable; `cpu-clock` (a timer)
# where they are not (most VMs, this CI machine). `perf stat -e instructions`
# decides: "<not supported>" means no counters, and the summary says so.
#
# perf itself: installed with apt-get (Debian's linux-perf) when missing and
# we are root, unless --no-install. inferno (the flame graph tools): installed
# with `cargo install inferno` when missing, unless --no-install; without it
# everything but the flame graph is produced and the summary says so.
#
# Exit status: 0 profiled (flame graph included unless the summary says
# otherwise); 1 the profiled command failed (its profile is still written);
# 2 usage; 3 setup failed (no perf, build failed, perf not permitted).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
readonly SCRIPT_DIR REPO_ROOT
readonly DEFAULT_FREQ_HZ=499
readonly DWARF_STACK_BYTES=16384
readonly TOP_SYMBOLS=25

usage() {
    cat <<'EOF'
Usage: scripts/profile.sh [options] SCENARIO
       scripts/profile.sh [options] -- SUBCOMMAND [ARGS...]

Profiles `cxlkv bench SCENARIO --json` (or `cxlkv SUBCOMMAND ARGS...`) with
perf record, and writes perf report output, a flame graph and a perf stat
summary into a directory.

Options:
  --out DIR              output directory
                         (default: bench-results/profile-<UTC timestamp>-<name>)
  --binary PATH          profile this cxlkv binary (default: build
                         target/release/cxlkv; env CXLKV_BIN)
  --call-graph dwarf|fp  stack unwinding (default dwarf; see the header)
  --freq HZ              sampling frequency (default 499)
  --quick                pass --quick to the bench scenario
  --reps N               pass --reps N to the bench scenario
  --pool PATH            pass --pool PATH to the bench scenario
  --no-stat              skip the perf stat run
  --no-install           never install perf or inferno
  -h, --help             this help
EOF
}

die_usage() { echo "profile: $*" >&2; echo "profile: see scripts/profile.sh --help" >&2; exit 2; }
die_setup() { echo "profile: $*" >&2; exit 3; }
say() { echo "profile: $*" >&2; }

OUT=""
BINARY="${CXLKV_BIN:-}"
CALL_GRAPH="dwarf"
FREQ="$DEFAULT_FREQ_HZ"
BENCH_FLAGS=()
DO_STAT=1
INSTALL=1
SCENARIO=""
SUBCOMMAND=()

need_value() { [[ $# -ge 2 && -n "$2" ]] || die_usage "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) need_value "$@"; OUT="$2"; shift 2 ;;
        --binary) need_value "$@"; BINARY="$2"; shift 2 ;;
        --call-graph) need_value "$@"; CALL_GRAPH="$2"; shift 2 ;;
        --freq) need_value "$@"; FREQ="$2"; shift 2 ;;
        --quick) BENCH_FLAGS+=(--quick); shift ;;
        --reps) need_value "$@"; BENCH_FLAGS+=(--reps "$2"); shift 2 ;;
        --pool) need_value "$@"; BENCH_FLAGS+=(--pool "$2"); shift 2 ;;
        --no-stat) DO_STAT=0; shift ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; SUBCOMMAND=("$@"); break ;;
        -*) die_usage "unknown option: $1" ;;
        *) [[ -z "$SCENARIO" ]] || die_usage "one scenario at a time (got '$SCENARIO' and '$1')"
           SCENARIO="$1"; shift ;;
    esac
done

if [[ -n "$SCENARIO" && ${#SUBCOMMAND[@]} -gt 0 ]]; then
    die_usage "give a SCENARIO or '-- SUBCOMMAND ...', not both"
fi
if [[ -z "$SCENARIO" && ${#SUBCOMMAND[@]} -eq 0 ]]; then
    die_usage "name a bench scenario (see: cxlkv bench --list) or '-- SUBCOMMAND ...'"
fi
if [[ ${#SUBCOMMAND[@]} -gt 0 && ${#BENCH_FLAGS[@]} -gt 0 ]]; then
    die_usage "--quick, --reps and --pool apply to a SCENARIO; put the subcommand's own flags after --"
fi
[[ "$CALL_GRAPH" == dwarf || "$CALL_GRAPH" == fp ]] || die_usage "--call-graph takes dwarf or fp, got '$CALL_GRAPH'"
{ [[ "$FREQ" =~ ^[0-9]+$ ]] && (( FREQ >= 1 )); } || die_usage "--freq takes a positive number of Hz, got '$FREQ'"

# --- perf --------------------------------------------------------------------

if ! command -v perf >/dev/null; then
    if (( INSTALL )) && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        say "perf not found; installing Debian's linux-perf (apt-get install linux-perf)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q linux-perf >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q linux-perf >/dev/null; } \
            || die_setup "apt-get install linux-perf failed (Ubuntu: linux-tools-\$(uname -r))"
    else
        die_setup "perf not found (Debian: apt-get install linux-perf; Ubuntu: apt-get install linux-tools-\$(uname -r)); run as root to have this script install it"
    fi
fi
perf --version >/dev/null 2>&1 || die_setup "'perf --version' fails: $(perf --version 2>&1 | head -n 2 | tr '\n' ' ')"

# Hardware counters: a number means usable, "<not supported>" or an error
# means not.
HW_COUNTERS=0
hw_probe="$(perf stat -x, -e instructions -- true 2>&1 >/dev/null || true)"
if grep -Eq '^[0-9]+,' <<<"$hw_probe"; then
    HW_COUNTERS=1
fi
if (( HW_COUNTERS )); then
    EVENT="cycles"
    COUNTERS_NOTE="hardware counters: available (perf stat -e instructions counts)"
else
    EVENT="cpu-clock"
    COUNTERS_NOTE="hardware counters: NOT available on this machine (perf stat -e instructions: $(grep -m1 -o '<not [a-z]*>' <<<"$hw_probe" || echo 'error')); sampling on cpu-clock, perf stat shows software counters only"
fi
# perf needs perf_event_paranoid <= 1 for a non-root user to profile its own
# processes with kernel stacks; check with a one-sample recording.
probe_dir="$(mktemp -d)"
if ! perf record -q -o "$probe_dir/probe.data" -e "$EVENT" -- true >/dev/null 2>"$probe_dir/err"; then
    err="$(head -n 3 "$probe_dir/err" | tr '\n' ' ')"
    rm -rf "$probe_dir"
    die_setup "perf record is not permitted here ($err); as root: sysctl kernel.perf_event_paranoid=1"
fi
rm -rf "$probe_dir"

# --- binary ------------------------------------------------------------------

if [[ -z "$BINARY" ]]; then
    command -v cargo >/dev/null || die_setup "cargo not found: pass --binary PATH to a built cxlkv"
    if [[ "$CALL_GRAPH" == fp ]]; then
        say "building cxlkv with frame pointers (target/frame-pointers)"
        (cd "$REPO_ROOT" && RUSTFLAGS="${RUSTFLAGS:-} -C force-frame-pointers=yes" \
            cargo build --release --bin cxlkv --target-dir target/frame-pointers) \
            || die_setup "cargo build failed"
        BINARY="$REPO_ROOT/target/frame-pointers/release/cxlkv"
    else
        say "building the release binary (cargo build --release --bin cxlkv)"
        (cd "$REPO_ROOT" && cargo build --release --bin cxlkv) || die_setup "cargo build failed"
        BINARY="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/cxlkv"
    fi
fi
[[ -x "$BINARY" ]] || die_setup "cxlkv binary '$BINARY' is missing or not executable"

if [[ -n "$SCENARIO" ]]; then
    CMD=("$BINARY" bench "$SCENARIO" --json "${BENCH_FLAGS[@]}")
    LABEL="$SCENARIO"
else
    CMD=("$BINARY" "${SUBCOMMAND[@]}")
    LABEL="${SUBCOMMAND[0]}"
fi
LABEL="${LABEL//[^A-Za-z0-9_-]/_}"

# --- inferno -----------------------------------------------------------------

export PATH="$PATH:${CARGO_HOME:-$HOME/.cargo}/bin"
FLAME_NOTE=""
if ! command -v inferno-collapse-perf >/dev/null || ! command -v inferno-flamegraph >/dev/null; then
    if (( INSTALL )) && command -v cargo >/dev/null; then
        say "inferno not found; installing it (cargo install inferno --locked; a few minutes)"
        cargo install inferno --locked >/dev/null 2>&1 \
            || FLAME_NOTE="flame graph: SKIPPED (cargo install inferno failed)"
    else
        FLAME_NOTE="flame graph: SKIPPED (inferno not installed: cargo install inferno)"
    fi
fi

# --- run ---------------------------------------------------------------------

if [[ -z "$OUT" ]]; then
    OUT="$REPO_ROOT/bench-results/profile-$(date -u +%Y%m%dT%H%M%SZ)-$LABEL"
fi
mkdir -p "$OUT" || die_setup "cannot create '$OUT'"

if [[ "$CALL_GRAPH" == dwarf ]]; then
    CALL_GRAPH_ARG="dwarf,$DWARF_STACK_BYTES"
else
    CALL_GRAPH_ARG="fp"
fi
{
    echo "command: ${CMD[*]}"
    echo "perf: $(perf --version)"
    echo "event: $EVENT at $FREQ Hz"
    echo "call graph: $CALL_GRAPH_ARG"
    echo "$COUNTERS_NOTE"
    echo "host: $(hostname -s 2>/dev/null || uname -n); kernel: $(uname -r)"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$OUT/command.txt"

STAT_NOTE="perf stat: skipped (--no-stat)"
if (( DO_STAT )); then
    say "perf stat: ${CMD[*]}"
    stat_events=()
    if (( HW_COUNTERS )); then
        stat_events=(-d)
    fi
    set +e
    perf stat "${stat_events[@]}" -o "$OUT/perf-stat.txt" -- "${CMD[@]}" >"$OUT/stat-output.txt" 2>&1 </dev/null
    stat_status=$?
    set -e
    if (( HW_COUNTERS )); then
        STAT_NOTE="perf stat: perf-stat.txt (with hardware counters)"
    else
        STAT_NOTE="perf stat: perf-stat.txt has software counters only (task-clock, context switches, page faults): no hardware counters here"
        printf '\nNOTE: hardware counters (cycles, instructions, caches) are not available on this machine.\n' >>"$OUT/perf-stat.txt"
    fi
    (( stat_status == 0 )) || STAT_NOTE="$STAT_NOTE; the command exited $stat_status"
fi

say "perf record ($EVENT, $FREQ Hz, call graph $CALL_GRAPH_ARG): ${CMD[*]}"
set +e
perf record -o "$OUT/perf.data" -e "$EVENT" -F "$FREQ" --call-graph "$CALL_GRAPH_ARG" \
    -- "${CMD[@]}" >"$OUT/output.txt" 2>"$OUT/perf-record.log" </dev/null
cmd_status=$?
set -e
[[ -s "$OUT/perf.data" ]] || die_setup "perf record wrote no data: $(tail -n 3 "$OUT/perf-record.log" | tr '\n' ' ')"

perf report -i "$OUT/perf.data" --stdio --no-children --percent-limit 1 \
    >"$OUT/perf-report.txt" 2>/dev/null
perf report -i "$OUT/perf.data" --stdio --no-children -g none --percent-limit 0.3 \
    >"$OUT/perf-top.txt" 2>/dev/null
samples="$(grep -Eo '[0-9]+ samples' "$OUT/perf-record.log" | tail -n 1 || true)"

if [[ -z "$FLAME_NOTE" ]]; then
    perf script -i "$OUT/perf.data" 2>/dev/null \
        | inferno-collapse-perf >"$OUT/stacks.folded"
    if [[ -s "$OUT/stacks.folded" ]] && inferno-flamegraph \
            --title "cxlkv ${CMD[*]:1}" --subtitle "$EVENT, $FREQ Hz, $CALL_GRAPH_ARG unwinding" \
            "$OUT/stacks.folded" >"$OUT/flamegraph.svg" 2>/dev/null; then
        FLAME_NOTE="flame graph: flamegraph.svg ($(wc -c <"$OUT/flamegraph.svg") bytes)"
    else
        rm -f "$OUT/flamegraph.svg"
        FLAME_NOTE="flame graph: SKIPPED (no stacks collected)"
    fi
fi

{
    cat "$OUT/command.txt"
    echo "exit status of the command: $cmd_status"
    echo "samples: ${samples:-unknown}"
    echo "$STAT_NOTE"
    echo "$FLAME_NOTE"
    echo
    echo "top symbols by self time (perf report --no-children; all in perf-top.txt):"
    grep -E '^ +[0-9.]+%' "$OUT/perf-top.txt" | head -n "$TOP_SYMBOLS" || true
} >"$OUT/summary.txt"

cat "$OUT/summary.txt"
say "results in $OUT"
(( cmd_status == 0 )) || { say "the profiled command exited $cmd_status (see output.txt)"; exit 1; }
exit 0
