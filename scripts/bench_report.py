#!/usr/bin/env python3
"""Turn a hwbench results directory into results.jsonl, run.json, summary.md
and SVG plots. Python 3 standard library only (runs on any box with python3).

Input (written by scripts/hwbench.sh):
  run-info.txt          "key: value" lines describing the run
  runs.tsv              scenario, exit status, seconds, timed_out (one row per
                        scenario that was started, in run order)
  scenarios/NAME.jsonl  the scenario's stdout (bench contract, DESIGN §7)
  scenarios/NAME.stderr its notes and errors
  machine/lscpu.txt     for the CPU line of the summary

Output:
  results.jsonl         every record that satisfies the contract, in run order
  run.json              run-info, per-scenario status, target evaluations
  summary.md            scenario status table, results table with targets,
                        missed targets, unstable targets, targets not checked
                        (no case of a scenario that ran matched them), plot
                        links
  plots/NAME.svg        per scenario: ours vs baseline per case, ratio per case
  plots/ratios.svg      every case's ratio on one log scale

A `ratio` target is judged on the less favourable of `ratio` (a ratio of
medians, which can pair two reps) and `ratio_paired_median` (the median of the
reps' own ratios) when the record has both, and is "unstable" rather than met
when the reps' own ratios (`ratio_min`, `ratio_max`) are more than
UNSTABLE_SPREAD apart and the worst rep misses it: one stalled rep must not
make a target look met (docs/benchmarks.md, "Targets").

A scenario is "ok" when it exited 0 and printed at least one line, every line
a valid contract record of that scenario. Anything else is a failure, and the
exit status is 1. Exit 2 means the directory itself could not be read.

Usage: bench_report.py RESULTS_DIR [--targets FILE]
"""

import argparse
import html
import json
import math
import re
import sys
from pathlib import Path

CONTRACT_NUMBERS = ("ours", "baseline", "ratio")

# A ratio target met by the medians but not by the worst rep, on a record
# whose reps' own ratios are more than this factor apart (ratio_max ÷
# ratio_min), is "unstable", not met: the reps disagree too much for the
# medians to settle it (a rep whose baseline stalled). Quiet hosts stay well
# inside it (reps within 1.1–1.5× of each other); a stalled phase is 2–10×.
UNSTABLE_SPREAD = 2.0
# The value of `met` for such a target.
UNSTABLE = "unstable"
CONTRACT_STRINGS = ("scenario", "case", "unit")

# Plot geometry (pixels).
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
LABEL_W = 250
VALUE_W = 380
RATIO_W = 300
GAP = 30
ROW_H = 34
BAR_H = 11
TOP = 62
BOTTOM = 44
OURS_COLOR = "#2f6db5"
BASELINE_COLOR = "#a0a0a0"
RATIO_GOOD = "#3a9a5b"
RATIO_BAD = "#d8733a"
MISS_COLOR = "#c8102e"
UNSTABLE_COLOR = "#8a6d00"


# --- reading -----------------------------------------------------------------


def read_run_info(path):
    info = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(": ")
            if sep:
                info[key.strip()] = value.strip()
    return info


def read_runs(path):
    runs = []
    lines = path.read_text().splitlines()
    for line in lines[1:]:
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 4:
            raise ValueError(f"{path}: malformed row {line!r}")
        runs.append(
            {
                "scenario": fields[0],
                "exit": int(fields[1]),
                "seconds": float(fields[2]),
                "timed_out": fields[3] == "1",
            }
        )
    return runs


def is_number(value):
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def contract_error(record, scenario):
    """Why `record` breaks the bench contract, or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    for key in CONTRACT_STRINGS:
        if not isinstance(record.get(key), str) or not record[key]:
            return f"field {key!r} missing or not a non-empty string"
    for key in CONTRACT_NUMBERS:
        if key not in record:
            return f"field {key!r} missing"
        if not is_number(record[key]):
            return f"field {key!r} is {record[key]!r}, not a finite number"
    if record["scenario"] != scenario:
        return f"scenario is {record['scenario']!r}, expected {scenario!r}"
    return None


def read_scenario(results_dir, run):
    """Valid records of one scenario and its status."""
    name = run["scenario"]
    out_path = results_dir / "scenarios" / f"{name}.jsonl"
    err_path = results_dir / "scenarios" / f"{name}.stderr"
    records, invalid = [], []
    text = out_path.read_text(errors="replace") if out_path.exists() else ""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            invalid.append(f"line {number}: not JSON ({err.msg})")
            continue
        problem = contract_error(record, name)
        if problem:
            invalid.append(f"line {number}: {problem}")
        else:
            records.append(record)
    stderr_lines = []
    if err_path.exists():
        stderr_lines = [
            l.strip() for l in err_path.read_text(errors="replace").splitlines()
        ]
        stderr_lines = [l for l in stderr_lines if l]
    last_error = stderr_lines[-1] if stderr_lines else ""

    if run["timed_out"]:
        status, detail = "timeout", f"stopped after {run['seconds']:.0f} s"
    elif run["exit"] != 0:
        status, detail = "failed", f"exit {run['exit']}: {last_error}"
    elif invalid:
        status = "invalid output"
        detail = f"{len(invalid)} line(s) break the contract; first: {invalid[0]}"
    elif not records:
        status, detail = "no records", last_error or "printed nothing"
    else:
        status, detail = "ok", ""
    return {
        **run,
        "status": status,
        "detail": detail,
        "records": records,
        "invalid_lines": invalid,
    }


def read_targets(path):
    targets = []
    if path is None:
        return targets
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[3] not in (">=", "<="):
            raise ValueError(f"{path}:{number}: expected 'scenario case metric >=|<= threshold [source]'")
        targets.append(
            {
                "scenario": fields[0],
                "case": re.compile(fields[1]),
                "case_pattern": fields[1],
                "metric": fields[2],
                "op": fields[3],
                "threshold": float(fields[4]),
                "source": fields[5] if len(fields) > 5 else "",
            }
        )
    return targets


def meets(value, target):
    if target["op"] == ">=":
        return value >= target["threshold"]
    return value <= target["threshold"]


def judged_ratio(record, target):
    """(value, met) of a `ratio` target: the less favourable of `ratio` and
    `ratio_paired_median`, and UNSTABLE instead of True when the reps'
    ratios are more than UNSTABLE_SPREAD apart and the worst one misses."""
    values = [record["ratio"]]
    if is_number(record.get("ratio_paired_median")):
        values.append(record["ratio_paired_median"])
    value = min(values) if target["op"] == ">=" else max(values)
    met = meets(value, target)
    low, high = record.get("ratio_min"), record.get("ratio_max")
    if met and is_number(low) and is_number(high):
        worst = low if target["op"] == ">=" else high
        if spread(low, high) > UNSTABLE_SPREAD and not meets(worst, target):
            met = UNSTABLE
    return value, met


def spread(low, high):
    """How far apart the reps' ratios are (ratio_max ÷ ratio_min): infinite
    when a rep's ratio is 0 (a stall that never answered), the widest of
    all."""
    return high / low if low > 0 else math.inf


def evaluate_targets(record, targets):
    """[(target, value or None, met)] for the targets of `record`; met is
    True, False, UNSTABLE (a `ratio` target: judged_ratio) or None.

    A case the scenario skipped (`skipped: true`, e.g. an io_uring case
    where io_uring is unavailable) carries zeros, not a measurement: its
    targets are not evaluated (value and met None)."""
    result = []
    for target in targets:
        if target["scenario"] != record["scenario"]:
            continue
        if not target["case"].fullmatch(record["case"]):
            continue
        if record.get("skipped") is True:
            result.append((target, None, None))
            continue
        value = record.get(target["metric"])
        if not is_number(value):
            result.append((target, None, None))
            continue
        if target["metric"] == "ratio":
            value, met = judged_ratio(record, target)
        else:
            met = meets(value, target)
        result.append((target, value, met))
    return result


def unchecked_targets(scenarios, evaluations, targets):
    """[(target, why)]: the targets of every scenario that ran which no
    record of it was checked against — no case matched (a `--pool` run's
    `dest=devdax` copy cases, `alloc --threads 8` without `threads=2`), or
    the scenario reported nothing."""
    ran = {s["scenario"]: s for s in scenarios}
    matched = {id(t) for _, evals in evaluations for t, _, _ in evals}
    result = []
    for target in targets:
        s = ran.get(target["scenario"])
        if s is None or id(target) in matched:
            continue
        if not s["records"]:
            why = f"the scenario reported no records ({s['status']})"
        else:
            cases = ", ".join(dict.fromkeys(r["case"] for r in s["records"]))
            why = f"no case matches `{target['case_pattern']}` (cases run: {cases})"
        result.append((target, why))
    return result


# --- formatting --------------------------------------------------------------


def fmt(value):
    """Four significant digits, no exponent for everyday magnitudes."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e7 or magnitude < 1e-3:
        return f"{value:.3e}"
    digits = max(0, 3 - int(math.floor(math.log10(magnitude))))
    return f"{value:.{digits}f}"


def target_text(target):
    op = "≥" if target["op"] == ">=" else "≤"
    threshold = target["threshold"]
    shown = str(int(threshold)) if threshold.is_integer() else f"{threshold:g}"
    return f"{target['metric']} {op} {shown}"


def judged_from(record, target, value):
    """Names the field a `ratio` target was judged on when it is not the
    `ratio` column (judged_ratio)."""
    if target["metric"] == "ratio" and value != record["ratio"]:
        return ": ratio_paired_median"
    return ""


def target_item(record, target, what):
    """A list item of summary.md naming a record's case, the target, `what`
    was found and where the target comes from."""
    source = f" ({target['source']})" if target["source"] else ""
    return (
        f"- `{record['scenario']}` `{record['case']}`: "
        f"{target_text(target)}, {what}{source}"
    )


def spread_text(record):
    low, high = record["ratio_min"], record["ratio_max"]
    if low <= 0:
        return f"reps' ratios {fmt(low)}–{fmt(high)}, a rep at {fmt(low)}"
    return f"reps' ratios {fmt(low)}–{fmt(high)}, {spread(low, high):.3g}× apart"


def md_cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def cpu_line(results_dir):
    lscpu = results_dir / "machine" / "lscpu.txt"
    fields = {}
    if lscpu.exists():
        for line in lscpu.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    if "Model name" not in fields:
        return "unknown"
    parts = [fields["Model name"]]
    if "CPU(s)" in fields:
        parts.append(f"{fields['CPU(s)']} CPUs")
    if "NUMA node(s)" in fields:
        parts.append(f"{fields['NUMA node(s)']} NUMA node(s)")
    return ", ".join(parts)


# --- summary.md --------------------------------------------------------------


def write_summary(results_dir, info, scenarios, evaluations, unchecked, plots):
    ok = sum(1 for s in scenarios if s["status"] == "ok")
    failed = len(scenarios) - ok
    missed = [
        (rec, t, v)
        for rec, evals in evaluations
        for (t, v, met) in evals
        if met is False
    ]
    unstable = [
        (rec, t, v)
        for rec, evals in evaluations
        for (t, v, met) in evals
        if met == UNSTABLE
    ]
    lines = [
        f"# cxlkv hardware benchmark: {info.get('host', 'unknown host')}, "
        f"{info.get('started', '')}",
        "",
        "`ratio > 1` means cxlkv is better than the baseline measured in the "
        "same run (throughputs: ours ÷ baseline; latencies: baseline ÷ ours).",
        "",
        "| | |",
        "|---|---|",
    ]
    for key in (
        "command",
        "host",
        "started",
        "finished",
        "commit",
        "binary version",
        "pool",
        "pinning",
        "threads",
        "chunk sizes",
        "reps",
        "quick",
        "interrupted",
    ):
        if key in info:
            lines.append(f"| {key} | {md_cell(info[key])} |")
    lines.append(f"| cpu | {md_cell(cpu_line(results_dir))} |")
    lines += [
        "",
        f"**{ok} of {len(scenarios)} scenario(s) ok, {failed} failed; "
        f"{len(missed)} documented target(s) missed, "
        + (f"{len(unstable)} unstable, " if unstable else "")
        + f"{len(unchecked)} not checked.** "
        "Machine details: `machine/`; raw records: `results.jsonl`, "
        "`scenarios/`.",
        "",
        "## Scenarios",
        "",
        "| scenario | status | records | seconds | detail |",
        "|---|---|---:|---:|---|",
    ]
    for s in scenarios:
        status = s["status"] if s["status"] == "ok" else f"**{s['status'].upper()}**"
        lines.append(
            f"| {md_cell(s['scenario'])} | {status} | {len(s['records'])} | "
            f"{s['seconds']:.1f} | {md_cell(s['detail'])} |"
        )
    lines += [
        "",
        "## Results",
        "",
        "| scenario | case | ours | baseline | unit | ratio | target |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    eval_iter = iter(evaluations)
    for s in scenarios:
        for record in s["records"]:
            _, evals = next(eval_iter)
            cells = []
            for target, value, met in evals:
                text = target_text(target)
                if record.get("skipped") is True:
                    cells.append(f"{text}: not checked (case skipped)")
                elif met is None:
                    cells.append(f"{text}: n/a")
                elif met == UNSTABLE:
                    cells.append(f"**UNSTABLE** {text} ({spread_text(record)})")
                elif met:
                    cells.append(f"{text}: ok")
                else:
                    cells.append(f"**MISS** {text} (is {fmt(value)}{judged_from(record, target, value)})")
            lines.append(
                f"| {md_cell(record['scenario'])} | {md_cell(record['case'])} | "
                f"{fmt(record['ours'])} | {fmt(record['baseline'])} | "
                f"{md_cell(record['unit'])} | {fmt(record['ratio'])} | "
                f"{md_cell('; '.join(cells))} |"
            )
        if s["status"] != "ok":
            lines.append(
                f"| {md_cell(s['scenario'])} | — | | | | | "
                f"**{s['status'].upper()}**: {md_cell(s['detail'])} |"
            )
    if missed:
        lines += ["", "## Missed targets", ""]
        for record, target, value in missed:
            lines.append(
                target_item(
                    record,
                    target,
                    f"measured {fmt(value)}{judged_from(record, target, value)}",
                )
            )
    if unstable:
        lines += [
            "",
            "## Unstable targets",
            "",
            "Met by the medians but not by every rep, whose own ratios are "
            f"more than {UNSTABLE_SPREAD:g}× apart: neither met nor missed; "
            "run the scenario again on a quieter host.",
            "",
        ]
        for record, target, value in unstable:
            lines.append(
                target_item(record, target, f"judged {fmt(value)}, {spread_text(record)}")
            )
    if unchecked:
        lines += [
            "",
            "## Targets not checked",
            "",
            "Documented targets of the scenarios that ran which no record was "
            "checked against:",
            "",
        ]
        for target, why in unchecked:
            source = f" ({target['source']})" if target["source"] else ""
            lines.append(
                f"- `{target['scenario']}` `{target['case_pattern']}`: "
                f"{target_text(target)}{source}: {why}"
            )
    if plots:
        lines += ["", "## Plots", ""]
        for title, rel in plots:
            lines.append(f"![{title}]({rel})")
            lines.append("")
    (results_dir / "summary.md").write_text("\n".join(lines).rstrip() + "\n")


# --- SVG ---------------------------------------------------------------------


def esc(text):
    return html.escape(str(text), quote=True)


def text_el(x, y, content, size=12, anchor="start", color="#222", weight="normal"):
    return (
        f"<text x='{x:.1f}' y='{y:.1f}' {FONT} font-size='{size}' "
        f"text-anchor='{anchor}' fill='{color}' font-weight='{weight}'>"
        f"{esc(content)}</text>"
    )


def rect_el(x, y, w, h, color, title=None):
    tip = f"<title>{esc(title)}</title>" if title else ""
    return (
        f"<rect x='{x:.1f}' y='{y:.1f}' width='{max(w, 0):.1f}' "
        f"height='{h:.1f}' fill='{color}'>{tip}</rect>"
    )


def line_el(x1, y1, x2, y2, color="#444", width=1, dash=None):
    dash_attr = f" stroke-dasharray='{dash}'" if dash else ""
    return (
        f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' "
        f"stroke='{color}' stroke-width='{width}'{dash_attr}/>"
    )


def shorten(text, limit=38):
    return text if len(text) <= limit else text[: limit - 1] + "…"


class LogRatioAxis:
    """Maps ratios to x on a log2 scale centred on parity (ratio 1)."""

    def __init__(self, x0, width, ratios):
        logs = [abs(math.log2(r)) for r in ratios if r > 0]
        self.span = max(1, math.ceil(max(logs, default=1.0)))
        self.x0, self.width = x0, width

    def x(self, ratio):
        value = max(-self.span, min(self.span, math.log2(ratio)))
        return self.x0 + self.width * (value + self.span) / (2 * self.span)

    def ticks(self):
        step = 1 if self.span <= 4 else 2
        for k in range(-self.span, self.span + 1, step):
            label = f"{2 ** k:g}" if k >= 0 else f"1/{2 ** -k:g}"
            yield 2.0**k, label


def ratio_panel(parts, axis, rows, top, height):
    """Diverging ratio bars from the parity line; rows: (y, ratio, targets)."""
    for value, label in axis.ticks():
        x = axis.x(value)
        parts.append(line_el(x, top - 4, x, top + height, "#ddd"))
        parts.append(text_el(x, top + height + 14, label, 10, "middle", "#555"))
    centre = axis.x(1.0)
    for y, ratio, evals in rows:
        if ratio <= 0:
            parts.append(text_el(centre + 4, y + BAR_H, "n/a", 11, "start", "#777"))
            continue
        x = axis.x(ratio)
        missed = any(met is False and t["metric"] == "ratio" for t, _, met in evals)
        # Reps that disagree (judged_ratio): neither met nor missed, as in
        # summary.md — a bar drawn as "met" there would contradict it.
        unstable = any(met == UNSTABLE and t["metric"] == "ratio" for t, _, met in evals)
        if missed:
            color, mark = MISS_COLOR, " MISS"
        elif unstable:
            color, mark = UNSTABLE_COLOR, " UNSTABLE"
        else:
            color, mark = (RATIO_GOOD if ratio >= 1 else RATIO_BAD), ""
        left, right = min(x, centre), max(x, centre)
        parts.append(rect_el(left, y + 2, right - left, BAR_H * 2 - 4, color, f"ratio {fmt(ratio)}{mark}"))
        label = fmt(ratio) + mark
        if ratio >= 1:
            parts.append(text_el(right + 4, y + BAR_H + 4, label, 11, "start", color))
        else:
            parts.append(text_el(left - 4, y + BAR_H + 4, label, 11, "end", color))
        for target, _, _ in evals:
            if target["metric"] != "ratio" or target["threshold"] <= 0:
                continue
            tx = axis.x(target["threshold"])
            parts.append(line_el(tx, y - 1, tx, y + BAR_H * 2 + 1, "#111", 2))
    parts.append(line_el(centre, top - 6, centre, top + height, "#222", 1.5))


def scenario_svg(name, records, evaluations):
    n = len(records)
    width = LABEL_W + VALUE_W + GAP + RATIO_W + 60
    height = TOP + n * ROW_H + BOTTOM
    vx0 = LABEL_W
    rx0 = LABEL_W + VALUE_W + GAP
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}'>",
        rect_el(0, 0, width, height, "white"),
        text_el(10, 22, f"cxlkv bench {name}", 16, weight="bold"),
        rect_el(vx0, 34, 12, 10, OURS_COLOR),
        text_el(vx0 + 16, 43, "ours (cxlkv)", 11),
        rect_el(vx0 + 110, 34, 12, 10, BASELINE_COLOR),
        text_el(vx0 + 126, 43, "baseline", 11),
        text_el(rx0 + RATIO_W / 2, 43, "ratio (log scale; > 1: cxlkv better; tick: target)", 11, "middle"),
    ]
    # Each unit gets its own scale, so mixed-unit scenarios stay readable.
    unit_max = {}
    for r in records:
        unit_max[r["unit"]] = max(unit_max.get(r["unit"], 0.0), r["ours"], r["baseline"])
    axis = LogRatioAxis(rx0, RATIO_W, [r["ratio"] for r in records])
    ratio_rows = []
    for i, (record, evals) in enumerate(zip(records, evaluations)):
        y = TOP + i * ROW_H
        if i % 2:
            parts.append(rect_el(0, y - 3, width, ROW_H, "#f6f6f6"))
        parts.append(text_el(LABEL_W - 8, y + BAR_H + 4, shorten(record["case"]), 11, "end"))
        scale = (VALUE_W - 90) / unit_max[record["unit"]] if unit_max[record["unit"]] > 0 else 0
        for k, (key, color) in enumerate((("ours", OURS_COLOR), ("baseline", BASELINE_COLOR))):
            value = record[key]
            by = y + k * BAR_H
            bw = max(0.0, value) * scale
            parts.append(rect_el(vx0, by, bw, BAR_H - 1, color, f"{key} {fmt(value)} {record['unit']}"))
            parts.append(text_el(vx0 + bw + 4, by + BAR_H - 2, f"{fmt(value)} {record['unit']}", 10, "start", "#333"))
        ratio_rows.append((y, record["ratio"], evals))
    body_h = n * ROW_H
    parts.append(line_el(vx0, TOP - 6, vx0, TOP + body_h, "#222"))
    ratio_panel(parts, axis, ratio_rows, TOP, body_h)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def overview_svg(records, evaluations, title):
    n = len(records)
    label_w = 360
    panel_w = 460
    width = label_w + panel_w + 80
    height = TOP + n * ROW_H + BOTTOM
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}'>",
        rect_el(0, 0, width, height, "white"),
        text_el(10, 22, title, 16, weight="bold"),
        text_el(label_w + panel_w / 2, 43, "ratio (log scale; > 1: cxlkv better; tick: target)", 11, "middle"),
    ]
    axis = LogRatioAxis(label_w, panel_w, [r["ratio"] for r in records])
    rows = []
    for i, (record, evals) in enumerate(zip(records, evaluations)):
        y = TOP + i * ROW_H
        if i % 2:
            parts.append(rect_el(0, y - 3, width, ROW_H, "#f6f6f6"))
        label = shorten(f"{record['scenario']}: {record['case']}", 52)
        parts.append(text_el(label_w - 8, y + BAR_H + 4, label, 11, "end"))
        rows.append((y, record["ratio"], evals))
    ratio_panel(parts, axis, rows, TOP, n * ROW_H)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# --- main --------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--targets", type=Path, default=None)
    args = parser.parse_args()
    results_dir = args.results_dir

    try:
        info = read_run_info(results_dir / "run-info.txt")
        runs = read_runs(results_dir / "runs.tsv")
        targets = read_targets(args.targets)
    except (OSError, ValueError) as err:
        print(f"bench_report: {err}", file=sys.stderr)
        return 2

    scenarios = [read_scenario(results_dir, run) for run in runs]
    evaluations = [
        (record, evaluate_targets(record, targets))
        for s in scenarios
        for record in s["records"]
    ]

    with open(results_dir / "results.jsonl", "w") as out:
        for s in scenarios:
            for record in s["records"]:
                out.write(json.dumps(record, sort_keys=False) + "\n")

    plots_dir = results_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    plots = []
    offset = 0
    for s in scenarios:
        count = len(s["records"])
        evals = [e for _, e in evaluations[offset : offset + count]]
        offset += count
        if not count:
            continue
        rel = f"plots/{s['scenario']}.svg"
        (results_dir / rel).write_text(scenario_svg(s["scenario"], s["records"], evals))
        plots.append((s["scenario"], rel))
    if evaluations:
        all_records = [r for r, _ in evaluations]
        all_evals = [e for _, e in evaluations]
        title = f"cxlkv bench ratios: {info.get('host', '')} {info.get('started', '')}".strip()
        (plots_dir / "ratios.svg").write_text(overview_svg(all_records, all_evals, title))
        plots.insert(0, ("all ratios", "plots/ratios.svg"))

    unchecked = unchecked_targets(scenarios, evaluations, targets)
    run_json = {
        "run": info,
        "scenarios": [
            {
                "scenario": s["scenario"],
                "status": s["status"],
                "detail": s["detail"],
                "exit": s["exit"],
                "seconds": s["seconds"],
                "timed_out": s["timed_out"],
                "records": len(s["records"]),
                "invalid_lines": s["invalid_lines"],
            }
            for s in scenarios
        ],
        "targets": [
            {
                "scenario": record["scenario"],
                "case": record["case"],
                "metric": target["metric"],
                "op": target["op"],
                "threshold": target["threshold"],
                "value": value,
                "met": None if met == UNSTABLE else met,
                "unstable": met == UNSTABLE,
                "source": target["source"],
            }
            for record, evals in evaluations
            for target, value, met in evals
        ],
        "unchecked_targets": [
            {
                "scenario": target["scenario"],
                "case_pattern": target["case_pattern"],
                "metric": target["metric"],
                "op": target["op"],
                "threshold": target["threshold"],
                "why": why,
                "source": target["source"],
            }
            for target, why in unchecked
        ],
    }
    (results_dir / "run.json").write_text(json.dumps(run_json, indent=2) + "\n")
    write_summary(results_dir, info, scenarios, evaluations, unchecked, plots)

    failed = [s["scenario"] for s in scenarios if s["status"] != "ok"]
    if failed:
        print(f"bench_report: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
