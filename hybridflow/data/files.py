"""Reading dataset rows (one dict per example) from jsonl, json or parquet files, with errors that name the file."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet")


def read_rows(path: str | Path) -> list[dict]:
    """All rows of a dataset file as dicts.

    .jsonl: one JSON object per line (blank lines skipped); .json: a JSON list of objects;
    .parquet: one row per record. ValueError for a missing file, another suffix, a malformed
    line, or a file with no rows.
    """
    if not str(path).strip():  # Path("") is the current directory
        raise ValueError(f"dataset file path is empty ({str(path)!r}); give a .jsonl, .json or .parquet file")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"dataset file {str(path)!r} is a directory; give a .jsonl, .json or .parquet file")
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    _check_not_compressed(path, suffix)
    try:
        rows = _read_by_suffix(path, suffix)
    except UnicodeDecodeError as error:
        raise ValueError(f"dataset file {str(path)!r} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
                         f"offset {error.start}); re-save the file as UTF-8") from None
    if not rows:
        raise ValueError(f"dataset file {str(path)!r} holds no rows")
    return rows


# magic numbers of the compressed formats a data file is most often mistaken for
COMPRESSED = {b"\x1f\x8b": ("gzip", "gunzip"), b"BZh": ("bzip2", "bunzip2"), b"\xfd7zXZ": ("xz", "unxz"),
              b"PK\x03\x04": ("zip", "unzip"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd")}


def _check_not_compressed(path: Path, suffix: str) -> None:
    if suffix == ".parquet":  # parquet compresses inside its own format
        return
    with path.open("rb") as handle:
        head = handle.read(6)
    for magic, (name, tool) in COMPRESSED.items():
        if head.startswith(magic):
            raise ValueError(f"dataset file {str(path)!r} is {name}-compressed, not {suffix} text; decompress it "
                             f"first ({tool})")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``' object hook: a key given twice in one object is an error (json keeps the last silently)."""
    row = {}
    for key, value in pairs:
        if key in row:
            raise _DuplicateKey(key)
        row[key] = value
    return row


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} appears twice in one object (JSON would silently keep the last)")


def _read_by_suffix(path: Path, suffix: str) -> list[dict]:
    if suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as error:
            raise ValueError(f"dataset file {str(path)!r} is not valid JSON: {error}") from None
        except _DuplicateKey as error:
            raise ValueError(f"dataset file {str(path)!r}: {error}") from None
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


UTF8_BOM = b"\xef\xbb\xbf"


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open("rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            if line_number == 1 and raw_line.startswith(UTF8_BOM):  # Windows editors start UTF-8 files with one
                raw_line = raw_line[len(UTF8_BOM):]
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"dataset file {str(path)!r} line {line_number} is not UTF-8 text (byte "
                                 f"{raw_line[error.start]:#04x} at column {error.start + 1}); re-save the file as "
                                 f"UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as error:
                raise ValueError(f"dataset file {str(path)!r} line {line_number} is not valid JSON: {error}") from None
            except _DuplicateKey as error:
                raise ValueError(f"dataset file {str(path)!r} line {line_number}: {error}") from None
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
    # written beside and renamed: a full disk or a Ctrl-C never leaves a truncated file under the real name
    partial = path.with_name(f".{path.name}.partial")
    try:
        with partial.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
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
    if field not in row:
        raise ValueError(
            f"row {row_index} of {source_name} has no field {field!r}; fields present: {sorted(row)}"
        )
    if row[field] is None:
        raise ValueError(f"row {row_index} of {source_name}: field {field!r} is null; give it a value or drop the row")
    return row[field]
