"""Prompt files: JSONL, JSON (an array of objects) or Parquet, read into rows with their origin.

Every row keeps where it came from (`file:line` for JSONL, `file row N` otherwise), so an error
anywhere later (a missing key, an overlong prompt, a reward that raised) names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_learner.data.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Row:
    values: dict[str, Any]
    origin: str


def resolve(path: str, base_dir: Path) -> Path:
    """A data path as written in the config: relative paths are relative to the config file."""
    candidate = Path(path)
    return candidate if candidate.is_absolute() else base_dir / candidate


def read_rows(path: Path, limit: int | None = None) -> list[Row]:
    """Every row of one file (JSONL: the first `limit` when given, without reading the rest);
    DataError names the file (and line) of anything malformed."""
    if not path.is_file():
        raise DataError(f"data file {path} not found; allowed: a local {', '.join(SUFFIXES)} file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, limit)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"data file {path}: unknown format {suffix!r}; allowed: {', '.join(SUFFIXES)}")


def _read_jsonl(path: Path, limit: int | None = None) -> list[Row]:
    rows: list[Row] = []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{number}: not valid JSON ({err.msg}, column {err.colno})"
                ) from None
            if not isinstance(value, dict):
                raise DataError(
                    f"{path}:{number}: a row must be a JSON object, got {type(value).__name__}"
                )
            rows.append(Row(value, f"{path}:{number}"))
    return rows


def _read_json(path: Path) -> list[Row]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise DataError(f"{path}: a JSON data file must hold an array of objects")
    return [Row(v, f"{path} row {i + 1}") for i, v in enumerate(value)]


def _read_parquet(path: Path) -> list[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:
        raise DataError(
            f"{path}: not a readable Parquet file ({type(err).__name__}: {err})"
        ) from None
    return [Row(v, f"{path} row {i + 1}") for i, v in enumerate(table.to_pylist())]


def read_files(paths: list[Path], required: list[str]) -> list[Row]:
    """The rows of every file, in order; each must hold the `required` keys; none may be empty."""
    rows = []
    for path in paths:
        found = read_rows(path)
        if not found:
            raise DataError(f"data file {path} holds no rows; allowed: at least one")
        for row in found:
            missing = [key for key in required if key not in row.values]
            if missing:
                raise DataError(
                    f"{row.origin}: missing key {missing[0]!r}; the row has: "
                    f"{', '.join(sorted(row.values)) or 'no keys'} (set [data] prompt_key, "
                    "messages_key or answer_key to the column names)"
                )
        rows.extend(found)
    return rows
