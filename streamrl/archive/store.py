"""The archive's files: Parquet through fsspec, one directory per topic.

Layout: ``<uri>/<topic>/part-<first record ms>-<writer>-<seq>.parquet``, ``topic`` the short
name (``rollouts``, ``rewarded``, ``deadletter``). A file is complete or absent: a local file is
written under a hidden temporary name, fsynced and renamed; an object store (``s3://``,
``gs://``) makes an object visible only when its upload completes. Readers skip hidden names.

One schema for every topic (``SCHEMA``): where the record came from (``topic``, ``partition``,
``offset``, ``timestamp_ms``), the columns a user filters on as real columns (``id``,
``group_id``, ``policy_version``, ``data_source``, ``reward``, ``scored_at``, ``created_at``;
``stage``, ``reason``, ``record_id`` of dead letters), the token arrays as Arrow lists of their
own dtype (exact: int32 ids, float32 log-probs, uint8 masks), and ``record``: the record's JSON
without its arrays. ``record`` plus the arrays is the record again, field for field.

A dead letter's ``id`` is where it sits in the dead-letter topic (``deadletter/<p>/<offset>``):
two stages may dead-letter the same trajectory, and the archive keeps both letters. Records are
archived at least once (a restart re-reads what was not committed); readers keep one per ``id``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from streamrl.archive.config import ARCHIVED
from streamrl.errors import Failure
from streamrl.records import _ARRAY_DTYPES, DEADLETTER_SCHEMA, DISTILLED_SCHEMA, REWARDED_SCHEMA, TRAJECTORY_SCHEMA, pack_array
from streamrl.reward.config import RewardConfig

_LIST_TYPES = {"int32": pa.int32(), "float32": pa.float32(), "uint8": pa.uint8()}
_NP = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "uint8": np.dtype("u1")}

SCHEMA = pa.schema([
    ("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp_ms", pa.int64()),
    ("id", pa.string()), ("group_id", pa.string()), ("policy_version", pa.int64()),
    ("data_source", pa.string()), ("reward", pa.float32()), ("scored_at", pa.float64()),
    ("created_at", pa.float64()), ("stage", pa.string()), ("reason", pa.string()), ("record_id", pa.string()),
    *[(name, pa.list_(_LIST_TYPES[dtype])) for name, dtype in _ARRAY_DTYPES.items()],
    ("record", pa.binary()),
])
_SCALARS = [f.name for f in SCHEMA if f.name not in _ARRAY_DTYPES and f.name != "record"]

#: The record schemas each topic holds (a replay topic may hold either record kind).
EXPECTED = {"rollouts": (TRAJECTORY_SCHEMA, REWARDED_SCHEMA), "rewarded": (REWARDED_SCHEMA, TRAJECTORY_SCHEMA),
            "distilled": (DISTILLED_SCHEMA,),
            "deadletter": (DEADLETTER_SCHEMA,)}
# column -> (python types it takes, kinds of record that must have it)
_TYPED = {"id": (str, "t"), "group_id": (str, "t"), "policy_version": (int, "t"), "data_source": (str, "t"),
          "reward": ((int, float), "r"), "scored_at": ((int, float), "r"), "created_at": ((int, float), ""),
          "stage": (str, "d"), "reason": (str, "d"), "record_id": (str, "")}
_INT64 = (-(2 ** 63), 2 ** 63 - 1)
#: The run's ``reward:`` section, kept with its records: replay resolves ``--scorer NAME`` with it,
#: so the scorer a run used re-scores its archive the same way (its kwargs included).
REWARD_CONFIG = "reward.yaml"


class ArchiveError(Failure):
    """A record the archive's schema cannot hold (``reason`` ``archive_schema`` or ``bad_json``):
    it goes to dead letters, the stage goes on."""


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, root path in it) for a local path or URI."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri if "://" in uri else os.path.abspath(uri))
    return fs, root.rstrip("/")


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _array(value: Any, dtype: str, name: str) -> np.ndarray:
    want = _NP[dtype]
    if isinstance(value, dict):
        if value.get("dtype") != dtype or not isinstance(value.get("b64"), str):
            raise ArchiveError("archive_schema", f"{name}: packed dtype {value.get('dtype')!r}, expected {dtype!r}")
        try:
            raw = base64.b64decode(value["b64"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ArchiveError("archive_schema", f"{name}: bad base64: {exc}") from None
        if len(raw) % want.itemsize:
            raise ArchiveError("archive_schema", f"{name}: {len(raw)} bytes is not a whole number of {dtype}")
        return np.frombuffer(raw, dtype=want)
    if not isinstance(value, list):
        raise ArchiveError("archive_schema", f"{name}: a {type(value).__name__}, expected a list or packed array")
    try:
        arr = np.asarray(value)
        if arr.ndim != 1 or (arr.size and not np.can_cast(arr.dtype, want, "same_kind")):
            raise ValueError(f"values of {arr.dtype}, {arr.ndim}-D")
        out = arr.astype(want)
        if arr.size and arr.dtype.kind in "iu" and not np.array_equal(out, arr):
            raise ValueError(f"values out of {dtype} range")
        return out
    except (TypeError, ValueError, OverflowError) as exc:
        raise ArchiveError("archive_schema", f"{name}: {exc}") from None


@dataclass
class Row:
    """One record as the archive stores it."""

    scalars: dict[str, Any]
    arrays: dict[str, np.ndarray | None]
    record: bytes
    size: int  # the message's bytes: what rolling counts


def to_row(topic: str, partition: int, offset: int, timestamp_ms: int, value: bytes | None) -> Row:
    """One message of ``topic`` (short name) as a row, or ``ArchiveError`` saying why the
    archive's schema cannot hold it: not a JSON object, a record kind the topic does not carry,
    or a filter column missing or of another type (schema drift). Fields the archive has no
    column for are kept in ``record`` whatever they are."""
    if value is None:
        raise ArchiveError("bad_json", "empty message (tombstone)")
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ArchiveError("bad_json", str(exc)) from None
    if not isinstance(obj, dict):
        raise ArchiveError("archive_schema", f"a record is a JSON object, got {type(obj).__name__}")
    kind = obj.get("schema")
    if kind not in EXPECTED.get(topic, ()):
        raise ArchiveError("archive_schema", f"schema {kind!r} on topic {topic}, expected "
                                             f"{' or '.join(EXPECTED.get(topic, ('?',)))}")
    tags = "d" if kind == DEADLETTER_SCHEMA else ("tr" if kind in (REWARDED_SCHEMA, DISTILLED_SCHEMA) else "t")
    scalars: dict[str, Any] = {"topic": topic, "partition": partition, "offset": offset,
                               "timestamp_ms": timestamp_ms if timestamp_ms is not None else -1}
    for name, (types, needed_by) in _TYPED.items():
        v = obj.get(name)
        if v is None:
            if any(t in tags for t in needed_by):
                raise ArchiveError("archive_schema", f"{name}: missing")
        elif isinstance(v, bool) or not isinstance(v, types):
            raise ArchiveError("archive_schema", f"{name}: {v!r} is a {type(v).__name__}")
        elif name == "policy_version" and not _INT64[0] <= v <= _INT64[1]:
            raise ArchiveError("archive_schema", f"{name}: {v} does not fit 64 bits")
        scalars[name] = v
    if kind == DEADLETTER_SCHEMA:
        scalars["id"] = f"deadletter/{partition}/{offset}"
    arrays = {}
    for name, dtype in _ARRAY_DTYPES.items():
        v = obj.pop(name, None)
        arrays[name] = None if v is None else _array(v, dtype, name)
    return Row(scalars, arrays, orjson.dumps(obj), len(value))


@dataclass
class Batch:
    """The rows of one topic waiting for their file."""

    topic: str
    rows: list[Row] = field(default_factory=list)
    bytes: int = 0
    started: float = 0.0  # monotonic time of the first row
    marks: list[Any] = field(default_factory=list)  # the writer's own bookkeeping, one per row

    def add(self, row: Row, now: float, mark: Any = None) -> None:
        if not self.rows:
            self.started = now
        self.rows.append(row)
        self.marks.append(mark)
        self.bytes += row.size

    def table(self) -> pa.Table:
        cols: dict[str, pa.Array] = {}
        for name in _SCALARS:
            cols[name] = pa.array([r.scalars.get(name) for r in self.rows], type=SCHEMA.field(name).type)
        for name, dtype in _ARRAY_DTYPES.items():
            cols[name] = _list_array([r.arrays[name] for r in self.rows], dtype)
        cols["record"] = pa.array([r.record for r in self.rows], type=pa.binary())
        return pa.Table.from_pydict(cols, schema=SCHEMA)


def _list_array(values: list[np.ndarray | None], dtype: str) -> pa.Array:
    lengths = np.array([0 if v is None else len(v) for v in values], dtype=np.int64)
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = [v for v in values if v is not None and len(v)]
    data = np.concatenate(flat) if flat else np.zeros(0, dtype=_NP[dtype])
    mask = pa.array([v is None for v in values], type=pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(data, type=_LIST_TYPES[dtype]), mask=mask)


class Writer:
    """Writes tables as complete files under ``<uri>/<topic>/``; ``write`` returns once the file
    is durable (fsynced locally, the upload completed on an object store)."""

    def __init__(self, uri: str, compression: str = "zstd"):
        self.uri = uri
        self.fs, self.root = filesystem(uri)
        self.compression = None if compression == "none" else compression
        self.writer_id = uuid.uuid4().hex[:8]
        self.seq = 0

    def write(self, topic: str, table: pa.Table) -> tuple[str, int]:
        """(path, bytes) of the new file."""
        first = int(min((t for t in table.column("timestamp_ms").to_pylist() if t and t > 0), default=0))
        self.seq += 1
        name = f"part-{first:013d}-{self.writer_id}-{self.seq:06d}.parquet"
        directory = f"{self.root}/{topic}"
        path = f"{directory}/{name}"
        if _is_local(self.fs):
            os.makedirs(directory, exist_ok=True)
            tmp = f"{directory}/.{name}.tmp"
            try:
                with open(tmp, "wb") as f:
                    pq.write_table(table, f, compression=self.compression)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)  # a full disk gets back what the failed write took
                raise
            os.replace(tmp, path)
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)  # the rename itself survives a power cut
            finally:
                os.close(fd)
            return path, os.path.getsize(path)
        self.fs.makedirs(directory, exist_ok=True)
        with self.fs.open(path, "wb") as f:
            pq.write_table(table, f, compression=self.compression)
        return path, int(self.fs.size(path))


    def write_text(self, name: str, text: str) -> None:
        """A small file at the archive's root (``REWARD_CONFIG``), replaced whole."""
        self.fs.makedirs(self.root, exist_ok=True)
        with self.fs.open(f"{self.root}/{name}", "w") as f:
            f.write(text)


# -- reading --------------------------------------------------------------------------------------

def reward_config(uri: str) -> Any:
    """The reward config the archived run scored with (``REWARD_CONFIG``, as the archive stage
    found it in its own config), as a ``RewardConfig``; None if the archive has none."""
    from omegaconf import OmegaConf

    from streamrl.config import load_section

    fs, root = filesystem(uri)
    path = f"{root}/{REWARD_CONFIG}"
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        doc = OmegaConf.create(f.read())
    return load_section(RewardConfig, doc.get("reward", doc), "reward", f"{uri.rstrip('/')}/{REWARD_CONFIG}")

def files(uri: str, topic: str) -> list[str]:
    """The complete files of ``topic`` in the archive, oldest name first (hidden names skipped)."""
    fs, root = filesystem(uri)
    try:
        found = fs.glob(f"{root}/{topic}/*.parquet")
    except FileNotFoundError:
        return []
    return sorted(p for p in found if not p.rsplit("/", 1)[-1].startswith("."))


def is_archive(uri: str) -> bool:
    """Whether ``uri`` holds an archive (a directory of any archived topic with a file)."""
    return any(files(uri, t) for t in ARCHIVED)


def read_tables(uri: str, topic: str, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Each file of ``topic`` as a table (``columns`` only, when given). The file's bytes are
    read here and handed to pyarrow as a buffer, never a Python file object: pyarrow's reader
    and pre-buffering threads calling back into a Python (fsspec) file made replay processes
    abort at interpreter exit ("terminate called without an active exception"; one in two, and
    still one in a few hundred with the reader threads off). ``read_table`` holds the whole file
    in memory anyway."""
    fs, _ = filesystem(uri)
    for path in files(uri, topic):
        with fs.open(path, "rb") as f:
            data = f.read()
        yield pq.read_table(pa.BufferReader(data), columns=columns, use_threads=False, pre_buffer=False)


def record_dict(table: pa.Table, i: int, keep_arrays: bool = True) -> dict[str, Any]:
    """Row ``i`` of an archive table as the record's dict, as it was on the topic (arrays packed
    as the codec packs them)."""
    obj = orjson.loads(table.column("record")[i].as_py())
    if keep_arrays:
        for name, dtype in _ARRAY_DTYPES.items():
            if name in table.column_names:
                cell = table.column(name)[i]
                if cell.is_valid:
                    obj[name] = pack_array(cell.values.to_numpy(zero_copy_only=False), dtype)
    return obj
