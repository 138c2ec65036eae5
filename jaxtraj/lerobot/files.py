"""Files that appear whole or not at all: staged under hidden names, then renamed into place.

Every file is first written to a temporary name next to its final one, ``.<name>.tmp-<pid>``.
The dot prefix and the suffix after ``.parquet`` keep it out of every LeRobot glob
(``data/*/*.parquet``, ``meta/episodes/*/*.parquet``), hidden files included, so a reader never
sees a half-written file, and never a whole one that is not yet published. ``publish`` moves
staged files into place with ``os.replace``, one atomic rename each, in the order given.
Renames are atomic against process death, not power loss: nothing is fsync'ed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

TMP_MARK = ".tmp-"

Staged = tuple[Path, Path]
"""A written temporary file and the path it is published to: ``(tmp, path)``."""


def commit(tmp: Path, path: Path) -> None:
    """Atomically move a finished temporary file into place (the one seam for crash tests)."""
    os.replace(tmp, path)


def tmp_path(path: Path) -> Path:
    """The hidden name a file is written under before it is published."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def is_tmp(path: Path) -> bool:
    return path.name.startswith(".") and TMP_MARK in path.name


def stage(path: Path, write: Callable[[Path], None]) -> Staged:
    """Write ``path``'s content to its temporary name with ``write(tmp)``; publish nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        write(tmp)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, path


def stage_table(path: Path, table: pa.Table, **options: Any) -> Staged:
    """Stage a parquet file; ``options`` go to ``pyarrow.parquet.write_table``."""
    return stage(path, lambda tmp: pq.write_table(table, tmp, **options))


def stage_json(path: Path, obj: Any, indent: int | None = 4) -> Staged:
    data = (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode()
    return stage(path, lambda tmp: tmp.write_bytes(data))


def publish(staged: Iterable[Staged]) -> None:
    """Rename staged files into place, in order."""
    for tmp, path in staged:
        commit(tmp, path)


def discard(staged: Iterable[Staged]) -> None:
    """Remove staged files that were not published (after a failed call)."""
    for tmp, _ in staged:
        tmp.unlink(missing_ok=True)


def write_table(path: Path, table: pa.Table, **options: Any) -> None:
    """Stage and publish a parquet file at once."""
    publish([stage_table(path, table, **options)])


def write_json(path: Path, obj: Any, indent: int | None = 4) -> None:
    """Stage and publish a JSON file at once."""
    publish([stage_json(path, obj, indent)])
