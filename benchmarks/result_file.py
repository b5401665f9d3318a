"""A benchmark's latest result, as one JSON file in benchmarks/results/.

docs/performance.md's table of current numbers is generated from those files
(`python benchmarks/report.py`); a bench script writes its file when given `--result-json`
(no path: its default file there, the one the table reads). The run's history stays in git.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]


def default_path(name: str) -> str:
    """Where the table reads benchmark `name`'s result."""
    return str(RESULTS / f"{name}.json")


def add_result_argument(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--result-json",
        nargs="?",
        const=default_path(name),
        default=None,
        metavar="PATH",
        help=f"write this run's result as JSON to PATH (no PATH: benchmarks/results/{name}.json, "
        "which docs/performance.md's table is generated from: python benchmarks/report.py)",
    )


def this_machine() -> str:
    """The CPU model and core count (and the GPU, where there is one): what a ratio was
    measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    machine = f"{cpu}, {os.cpu_count()} cores"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    return machine


def without_result_argument(argv: list[str]) -> list[str]:
    """The arguments but `--result-json [PATH]`: where the result went is not how it was run."""
    kept, skip = [], False
    for arg in argv:
        if skip and not arg.startswith("-"):
            skip = False
            continue
        skip = arg == "--result-json"
        if not skip and not arg.startswith("--result-json="):
            kept.append(arg)
    return kept


def this_command() -> str:
    """The command that ran this script, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(REPO):
        script = script.relative_to(REPO)
    command = shlex.join(["python", str(script), *without_result_argument(sys.argv[1:])])
    world = os.environ.get("WORLD_SIZE")
    if os.environ.get("TORCHELASTIC_RUN_ID") and world and world != "1":
        command = f"torchrun --nproc-per-node {world} " + command.removeprefix("python ")
    return command


def print_result(result: dict[str, Any]) -> None:
    """The command and each of a run's numbers, one per line, as a person reads them."""
    print(f"command: {' '.join(sys.argv)}")
    width = max(map(len, result), default=0)
    for key, value in result.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:>{width}}: {shown}")


def write_result(
    path: str | os.PathLike | None,
    *,
    benchmark: str,
    metric: str,
    ratio: str,
    details: dict[str, Any] | None = None,
) -> None:
    """Write one result (nothing when `path` is None): the table's row (benchmark, metric,
    ratio, command, machine) and the run's own numbers (`details`)."""
    if path is None:
        return
    record = {
        "benchmark": benchmark,
        "metric": metric,
        "ratio": ratio,
        "command": f"`{this_command()}`",
        "machine": this_machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "details": details or {},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"result: {path}")
