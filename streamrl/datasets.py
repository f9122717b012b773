"""Datasets by name or by file, so a config says ``feed.dataset: gsm8k`` or ``feed.dataset: PATH``.

A dataset is one of:

- a hub name: ``gsm8k`` / ``gsm8k:train`` (7473 rows), ``gsm8k:test`` (1319 rows). streamrl ships
  no data: GSM8K is loaded through the ``datasets`` library (the ``[hf]`` extra) from the Hugging
  Face hub, ``openai/gsm8k`` config ``main``, as verl's ``examples/data_preprocess/gsm8k.py``
  loads it. ``datasets`` caches what it loaded (under ``HF_HOME``), so later runs read the cache,
  also offline (``HF_HUB_OFFLINE=1`` skips the hub check);
- ``hf:REPO[:CONFIG][@SPLIT]``: any hub dataset the same way, e.g. ``hf:openai/gsm8k:main@test``;
- a file: ``.jsonl`` / ``.json`` (one object a line), either gzipped (``.gz``), or ``.parquet``
  (verl's preprocessed files read as they are).

A hub dataset that can be neither fetched nor found in the cache fails in one line that names
both ways to get it: connect once, or give a file.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Iterator

import orjson

from streamrl.errors import ConfigError, MissingExtra, StreamrlError, need
from streamrl.tasks import is_task, task_rows

#: hub name -> (repo, config), as verl's preprocessing loads it; ``NAME:SPLIT`` picks a split
HUB_NAMES = {"gsm8k": ("openai/gsm8k", "main")}
#: a hub repo whose only useful config has to be named
_HF_DEFAULT_CONFIG = {repo: config for repo, config in HUB_NAMES.values()}
_FILE_HINT = "a verl-prepared .parquet or a .jsonl[.gz] of rows"


class DatasetError(StreamrlError, ValueError):
    """A dataset row that cannot be read or become a prompt; the message names the file and row."""


def _hub_spec(spec: str) -> tuple[str, str, str] | None:
    """``(repo, config, split)`` of a hub name or an ``hf:`` spec; None for a file."""
    if spec.startswith("hf:"):
        rest, _, split = spec[3:].partition("@")
        repo, _, config = rest.partition(":")
        return repo, config or _HF_DEFAULT_CONFIG.get(repo, ""), split or "train"
    name, _, split = spec.partition(":")
    if name in HUB_NAMES:
        repo, config = HUB_NAMES[name]
        return repo, config, split or "train"
    return None


def describe(spec: str) -> str:
    """What ``spec`` names, for messages and logs."""
    hub = _hub_spec(spec)
    if hub is None:
        return spec
    repo, config, split = hub
    return f"{spec} (Hugging Face {repo}{':' + config if config else ''}@{split})"


def read_rows(spec: str, limit: int = 0, field: str = "feed.dataset") -> list[dict[str, Any]]:
    """The rows of dataset ``spec`` (see the module doc), at most ``limit`` (0: all). A spec that
    names nothing raises ``ConfigError`` naming ``field``."""
    if not spec:
        raise ConfigError(f"config field {field!r}: required: a generated task (streamrl.tasks), "
                          f"{' / '.join(HUB_NAMES)} (the Hugging Face hub), hf:REPO, or a file ({_FILE_HINT})")
    if is_task(spec):  # generated in code (streamrl.tasks)
        return task_rows(spec, limit)
    hub = _hub_spec(spec)
    if hub is not None:
        return _read_hub(spec, *hub, limit=limit, field=field)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"config field {field!r}: no file {spec!r} (or a hub name: "
                          f"{', '.join(HUB_NAMES)}, hf:REPO)")
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _read_hub(spec: str, repo: str, config: str, split: str, *, limit: int, field: str) -> list[dict[str, Any]]:
    """A split of a hub dataset through ``datasets.load_dataset`` (which fetches it once and
    reads its own cache after that)."""
    where = f"config field {field!r}: {spec!r}"
    try:
        datasets = need("datasets", "hf", where)
    except MissingExtra as exc:
        raise MissingExtra(f"{exc} (or give a file: {field}=PATH, {_FILE_HINT})") from None
    try:
        ds = datasets.load_dataset(repo, config or None, split=f"{split}[:{limit}]" if limit else split)
    except OSError as exc:  # ConnectionError: offline and not cached; FileNotFoundError: not on the hub
        cache = datasets.config.HF_DATASETS_CACHE
        raise ConfigError(f"{where}: Hugging Face {repo}{':' + config if config else ''} is neither reachable "
                          f"nor in the datasets cache ({cache}; {_first_line(exc)}): connect once to the hub "
                          f"(then it is cached, also for HF_HUB_OFFLINE=1), or give a file: {field}=PATH "
                          f"({_FILE_HINT})") from None
    except ValueError as exc:  # an unknown split or config
        raise ConfigError(f"{where}: {_first_line(exc)}") from None
    return ds.to_list()
