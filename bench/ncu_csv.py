"""Reading Nsight Compute's CSV (`ncu --csv`, one row per kernel launch and metric): each
launch's name, duration and warp-stall reasons, in launch order. Shared by the scripts that
summarise profiles (decode_profile.py, ncu_step_compare.py)."""
import collections
import csv
import re
import sys

# Nsight Compute reports each stall metric as .ratio, .pct and .max_rate; .ratio is warps per issue.
STALL = re.compile(r"smsp__average_warps_issue_stalled_(.+)_per_issue_active\.ratio")


def number(text):
    return float(text.replace(",", ""))


def microseconds(value, unit, tool):
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    if unit not in scale:
        sys.exit(f"{tool}: a duration in unknown unit {unit!r}")
    return value * scale[unit]


def read_launches(path, tool):
    """Launches in order: (kernel name without its argument list, microseconds, {stall reason:
    value}). Every launch must carry gpu__time_duration.sum; `tool` names the caller in errors."""
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    launches = collections.OrderedDict()
    for r in csv.DictReader(lines):
        key = int(r["ID"])
        entry = launches.setdefault(key, [re.sub(r"\(.*", "", r["Kernel Name"]), None, {}])
        metric, value = r["Metric Name"], r["Metric Value"]
        if metric == "gpu__time_duration.sum":
            entry[1] = microseconds(number(value), r.get("Metric Unit", "ns"), tool)
        elif (m := STALL.fullmatch(metric)) and value not in ("", "n/a"):
            entry[2][m.group(1)] = number(value)
    missing = [k for k, e in launches.items() if e[1] is None]
    if missing:
        sys.exit(f"{tool}: {len(missing)} launches without gpu__time_duration.sum")
    return [tuple(launches[k]) for k in sorted(launches)]
