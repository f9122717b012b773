"""Datasets by name, so a config says ``feed.dataset: gsm8k`` and works wherever streamrl is
installed.

A dataset is one of:

- a packaged name: ``gsm8k`` (GSM8K train, 7473 rows), ``gsm8k:test`` (1319 rows). GSM8K ships
  inside the package (``streamrl/data/gsm8k``, MIT, openai/grade-school-math; the licence sits
  beside it) as gzipped JSONL;
- a file: ``.jsonl`` / ``.json`` (one object a line), either gzipped (``.gz``), or ``.parquet``
  (verl's preprocessed files read as they are);
- ``hf:REPO[:CONFIG][@SPLIT]``: a Hugging Face dataset through the ``datasets`` library (the
  ``[hf]`` extra, for machines that reach a hub), e.g. ``hf:openai/gsm8k`` (config ``main``,
  split ``train``) or ``hf:openai/gsm8k:main@test``.
"""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import orjson

from streamrl.errors import ConfigError, StreamrlError, need
from streamrl.tasks import is_task, task_rows

#: packaged name -> file under ``streamrl/data``
PACKAGED = {
    "gsm8k": "gsm8k/train.jsonl.gz",
    "gsm8k:train": "gsm8k/train.jsonl.gz",
    "gsm8k:test": "gsm8k/test.jsonl.gz",
}
#: a Hugging Face repo whose only useful config has to be named
_HF_DEFAULT_CONFIG = {"openai/gsm8k": "main"}


class DatasetError(StreamrlError, ValueError):
    """A dataset row that cannot be read or become a prompt; the message names the file and row."""


def packaged_path(name: str) -> Path:
    """The packaged file of ``name`` (``gsm8k``, ``gsm8k:test``)."""
    rel = PACKAGED[name]
    return Path(str(resources.files("streamrl") / "data" / rel))


def describe(spec: str) -> str:
    """What ``spec`` names, for messages and logs."""
    return f"{spec} (packaged)" if spec in PACKAGED else spec


def read_rows(spec: str, limit: int = 0, field: str = "feed.dataset") -> list[dict[str, Any]]:
    """The rows of dataset ``spec`` (see the module doc), at most ``limit`` (0: all). A spec that
    names nothing raises ``ConfigError`` naming ``field``."""
    if not spec:
        raise ConfigError(f"config field {field!r}: required: a packaged name ({', '.join(PACKAGED)}), "
                          f"a .jsonl/.jsonl.gz/.parquet file, or hf:REPO")
    if spec.startswith("hf:"):
        return _read_hf(spec[3:], limit)
    if is_task(spec):  # generated in code (streamrl.tasks)
        return task_rows(spec, limit)
    path = packaged_path(spec) if spec in PACKAGED else Path(spec)
    if not path.is_file():
        raise ConfigError(f"config field {field!r}: no file {spec!r} (packaged names: {', '.join(PACKAGED)})")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return (table.slice(0, limit) if limit else table).to_pylist()
    rows = []
    for row in _jsonl(path):
        rows.append(row)
        if limit and len(rows) >= limit:
            break
    return rows


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: a row is a JSON object")
            yield row


def _read_hf(spec: str, limit: int) -> list[dict[str, Any]]:
    datasets = need("datasets", "hf", f"dataset 'hf:{spec}'")
    spec, _, split = spec.partition("@")
    repo, _, config = spec.partition(":")
    config = config or _HF_DEFAULT_CONFIG.get(repo, "")
    split = split or "train"
    ds = datasets.load_dataset(repo, config or None, split=f"{split}[:{limit}]" if limit else split)
    return [dict(row) for row in ds]
