"""docs/performance.md's table of current numbers is generated from benchmarks/results/*.json
(benchmarks/report.py): the doc must be what the results say today, every bench script must
be able to write its result, and what a script writes is what the table reads."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def load(name: str):
    """A module of benchmarks/ by its path (the scripts import each other as top-level
    modules, as `python benchmarks/bench_x.py` runs them)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    return load("report")


def test_docs_performance_md_table_is_up_to_date(report):
    doc = (ROOT / "docs/performance.md").read_text()
    assert doc == report.with_table(doc, report.render_table(report.load_results())), (
        "docs/performance.md is out of date: run python benchmarks/report.py"
    )


def test_every_result_is_a_row_in_the_order(report):
    results = report.load_results()
    assert set(results) <= set(report.ORDER), "name the new result in report.ORDER"
    table = report.render_table(results).splitlines()
    assert len(table) == 2 + len(results)


def test_every_bench_script_can_write_its_result():
    for script in sorted(BENCHMARKS.glob("bench_*.py")):
        calls = {
            node.func.id
            for node in ast.walk(ast.parse(script.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        assert {"add_result_argument", "write_result"} <= calls, script.name


def test_a_written_result_is_a_row(report, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    result_file = load("result_file")
    monkeypatch.setattr(
        sys, "argv", [str(BENCHMARKS / "bench_x.py"), "--result-json", "x.json", "--steps", "2"]
    )
    result_file.write_result(
        tmp_path / "x.json", benchmark="b", metric="m", ratio="1.23", details={"s": 1.0}
    )
    results = report.load_results(tmp_path)
    assert json.loads((tmp_path / "x.json").read_text())["details"] == {"s": 1.0}
    row = report.render_table(results).splitlines()[-1]
    assert row.startswith("| b | m | 1.23 | `python benchmarks/bench_x.py --steps 2` | ")


def test_a_result_without_a_column_is_refused(report, tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "b", "metric": "m"}))
    with pytest.raises(ValueError, match="no ratio, command, machine"):
        report.load_results(tmp_path)
