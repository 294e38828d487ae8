"""Reading dataset rows (one dict per example) from jsonl, json or parquet files, with errors that name the file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet")


def read_rows(path: str | Path) -> list[dict]:
    """All rows of a dataset file as dicts.

    .jsonl: one JSON object per line (blank lines skipped); .json: a JSON list of objects;
    .parquet: one row per record. ValueError for a missing file, another suffix, a malformed
    line, or a file with no rows.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"dataset file {str(path)!r} is a directory; give a .jsonl, .json or .parquet file")
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    try:
        rows = _read_by_suffix(path, suffix)
    except UnicodeDecodeError as error:
        raise ValueError(f"dataset file {str(path)!r} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
                         f"offset {error.start}); re-save the file as UTF-8") from None
    if not rows:
        raise ValueError(f"dataset file {str(path)!r} holds no rows")
    return rows


def _read_by_suffix(path: Path, suffix: str) -> list[dict]:
    if suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"dataset file {str(path)!r} is not valid JSON: {error}") from None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"dataset file {str(path)!r}: a .json dataset must be a list of objects")
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as error:  # pyarrow's errors (ArrowInvalid, ...) do not name the file
            raise ValueError(f"dataset file {str(path)!r} is not a readable parquet file: {error}") from None
    else:
        raise ValueError(f"dataset file {str(path)!r} has suffix {suffix!r}; allowed: {', '.join(SUFFIXES)}")
    return rows


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open("rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"dataset file {str(path)!r} line {line_number} is not UTF-8 text (byte "
                                 f"{raw_line[error.start]:#04x} at column {error.start + 1}); re-save the file as "
                                 f"UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"dataset file {str(path)!r} line {line_number} is not valid JSON: {error}") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"dataset file {str(path)!r} line {line_number} is a {type(row).__name__}, not an object"
                )
            rows.append(row)
    return rows


def write_jsonl(path: str | Path, rows: Sequence[dict]) -> Path:
    """Write rows as jsonl (creating parent directories) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def load_rows(source: str | Path | Sequence[dict], *, description: str = "dataset") -> tuple[list[dict], str]:
    """Rows from a file path or an in-memory list of dicts -> (rows, a name for error messages)."""
    if isinstance(source, (str, Path)):
        return read_rows(source), repr(str(source))
    rows = list(source)
    if not rows:
        raise ValueError(f"{description} given as a list holds no rows")
    if not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{description} given as a list must hold dicts, one per row")
    return rows, f"<{description} of {len(rows)} in-memory rows>"


def require_field(row: dict, field: str, *, row_index: int, source_name: str) -> object:
    """row[field], or a ValueError naming the field, the source and the fields the row has."""
    if field not in row or row[field] is None:
        raise ValueError(
            f"row {row_index} of {source_name} has no field {field!r}; fields present: {sorted(row)}"
        )
    return row[field]
