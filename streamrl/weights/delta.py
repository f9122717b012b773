"""Versions published by the change (``learner.weights_delta``): the bitwise XOR of each tensor
against the previous version's, in the published dtype, compressed with zstd; and their
reconstruction, bit-exact, wherever a version is read.

Why XOR in the published dtype: one RL step at RL learning rates moves most bf16 weights by less
than half a unit in the last place, so most of them do not change at all, and the XOR of two
versions is mostly zeros (a few percent of the bytes). XOR is exact whatever the values (NaN,
signed zeros), so a reconstructed version is the same bytes as the full one, not a close one.

A version directory ``v<N>`` written by ``DeltaWriter`` holds ``streamrl-weights.json`` (the
manifest) beside what ``save_policy`` writes (config, tokenizer):

- a full version: the ``*.safetensors`` files as always, and the manifest's checksums of them;
- a delta: per ``*.safetensors`` file a ``<file>.xor.zst`` instead, one zstd frame of the changed
  tensors' segments (each tensor either sparse, the positions of the changed elements as gaps
  and their XOR, or dense, its XOR's bytes split into planes, whichever is smaller; unchanged
  tensors nothing), and the manifest names its base (``base_version``, the version before), the
  chain's full version (``full_version``) and the base's checksum.

The checksum (xxh3-128 over each file's bytes, the header included) is of the reconstructed
files: a reader applies a delta only onto a base whose checksum the delta names, and keeps the
result only when its checksum is the version's. A reader that does not hold the base (it
started late, restarted, skipped versions) rebuilds from the chain's full version ``v<F>`` and
the deltas after it, its siblings in the same directory; any failure (a corrupt or missing
file) forgets what it held and fails the load (``WeightLoadError``), so the next attempt starts
again from the full version. Never a wrong weight.

The learner writes a full version every ``learner.weights_full_every`` versions, on every
``keep_every``-th (the eval stage's kept versions need no chain), at its first version in a
process (a new run, a resume, a new line) and when a file's layout changes (dtype, shape, names).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from streamrl.errors import need

log = logging.getLogger(__name__)

MANIFEST = "streamrl-weights.json"
FORMAT = "streamrl.weights/1"
SUFFIX = ".xor.zst"  # a delta file: <name>.safetensors.xor.zst
#: safetensors dtypes -> bytes per element (the XOR works on elements of this width)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(Exception):
    """A delta version cannot be reconstructed here (a checksum differs, a file is missing)."""


def _zstd() -> Any:
    return need("zstandard", "delta", "weights by delta (learner.weights_delta)")


def _xxhash() -> Any:
    return need("xxhash", "delta", "weights by delta (learner.weights_delta)")


def require() -> None:
    """The packages deltas need are here, or ``MissingExtra`` naming the extra."""
    _zstd()
    _xxhash()


def checksum(data: np.ndarray | bytes) -> str:
    """xxh3-128 of the bytes (a few hundredths of a second per GB)."""
    return _xxhash().xxh3_128_hexdigest(memoryview(data))


def combined(sums: dict[str, str]) -> str:
    """One checksum of a version: of its files' checksums, by name."""
    return checksum(json.dumps(sorted(sums.items())).encode())


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a version directory; None: a version written without it (full, as before)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise DeltaError(f"{path}: format {manifest.get('format')!r}, this streamrl reads {FORMAT!r}")
    return manifest


def _header(buf: np.ndarray) -> tuple[int, dict[str, Any]]:
    """(where the data starts, the safetensors header) of a file's bytes."""
    n = int(buf[:8].view("<u8")[0])
    return 8 + n, json.loads(buf[8:8 + n].tobytes())


def _tensors(buf: np.ndarray) -> list[tuple[str, int, int, int]]:
    """``(name, begin, end, itemsize)`` of each tensor of a safetensors file, by offset."""
    start, header = _header(buf)
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        size = ITEMSIZE.get(info["dtype"], 1)
        if (end - begin) % size:
            size = 1
        out.append((name, start + begin, start + end, size))
    return sorted(out, key=lambda t: t[1])


def _same_layout(a: np.ndarray, b: np.ndarray) -> bool:
    """Same size and the same header bytes: the same tensors (names, dtypes, shapes) at the same places."""
    if a.size != b.size or a.size < 8:
        return False
    start, _ = _header(a)
    return bool(np.array_equal(a[:start], b[:start]))


# -- encoding ---------------------------------------------------------------------------------------
def encode(base: np.ndarray, new: np.ndarray, level: int = 1) -> tuple[bytes, list[list[Any]]]:
    """The delta of two safetensors files of the same layout: one zstd frame and its table of
    segments (``[name, mode, count, length]``; ``s``: ``count`` changed elements, their gaps as
    uint32 then their XOR; ``d``: the XOR of every element, byte planes one after another).

    Each segment is written once, straight into its place in the payload (a buffer of the file's
    size, whose pages are touched only as far as written), not built apart and concatenated
    after (a copy of the payload and its page faults less: fp32 encodes in a third of the time):
    the same payload, so the same frame."""
    payload = np.empty(new.nbytes, np.uint8)  # a segment is at most its tensor's bytes
    table: list[list[Any]] = []
    at = 0
    for name, begin, end, size in _tensors(new):
        dtype = _UINT[size]
        x = np.bitwise_xor(base[begin:end].view(dtype), new[begin:end].view(dtype))
        count = int(np.count_nonzero(x))  # (counted first: the positions only where they are few)
        if count == 0:
            continue
        if count * (4 + size) < x.nbytes // 2 and x.size < 2**32:
            changed = np.flatnonzero(x)
            parts = [np.diff(changed, prepend=-1).astype(np.uint32).view(np.uint8), x[changed].view(np.uint8)]
            mode, count = "s", int(changed.size)
        else:
            parts = [x.view(np.uint8).reshape(-1, size).T]  # byte planes: alike bytes together
            mode, count = "d", int(x.size)
        start = at
        for part in parts:
            np.copyto(payload[at:at + part.size].reshape(part.shape), part)
            at += part.size
        table.append([name, mode, count, at - start])
    frame = _zstd().ZstdCompressor(level=level, threads=-1 if at > 1 << 24 else 0).compress(payload[:at])
    return frame, table


#: bytes of a plane decompressed at a time: a chunk stays in cache while it is XORed into the tensor
CHUNK = 1 << 18


def apply(base: np.ndarray, frame: bytes, table: list[list[Any]]) -> None:
    """Apply a delta (``encode``'s) to ``base``, a file's bytes, in place.

    Why streamed: the frame is decompressed a segment, or for a dense one a ``CHUNK`` of a byte
    plane, at a time into a small buffer, and each plane's chunk is XORed straight into its bytes
    of the tensor (a strided view). Decompressing the whole payload into a new buffer and
    transposing each dense tensor's planes into elements took twice as long (page faults on the
    payload-sized buffer, numpy's slow copy of a (planes, n) transpose) and held the payload twice."""
    if not table:
        return
    where = {name: (begin, end, size) for name, begin, end, size in _tensors(base)}
    reader = _zstd().ZstdDecompressor().stream_reader(frame)
    chunk = np.empty(CHUNK, np.uint8)
    for name, mode, count, length in table:
        if name not in where:
            raise DeltaError(f"the delta names tensor {name!r}, which the base does not have")
        begin, end, size = where[name]
        if mode == "s":
            seg = _read(reader, np.empty(length, np.uint8))
            dtype = _UINT[size]
            index = np.cumsum(seg[:4 * count].view(np.uint32), dtype=np.int64) - 1
            base[begin:end].view(dtype)[index] ^= seg[4 * count:].view(dtype)
        else:
            if length != end - begin:
                raise DeltaError(f"tensor {name!r}: a dense segment of {length} bytes, the tensor has {end - begin}")
            planes = base[begin:end].reshape(-1, size)  # column k: the tensor's k-th byte of each element
            for k in range(size):
                for at in range(0, planes.shape[0], CHUNK):
                    part = planes[at:at + CHUNK, k]
                    np.bitwise_xor(part, _read(reader, chunk[:part.size]), out=part)
    if reader.read(1):
        raise DeltaError(f"delta payload longer than its table's {sum(row[3] for row in table)} bytes")


def _read(reader: Any, out: np.ndarray) -> np.ndarray:
    """``out`` filled from a zstd stream reader (which may return less than asked)."""
    view, got = memoryview(out), 0
    while got < out.nbytes:
        n = reader.readinto(view[got:])
        if not n:
            raise DeltaError(f"delta payload shorter than its table: {out.nbytes - got} bytes missing in a segment")
        got += n
    return out


# -- the learner's side -----------------------------------------------------------------------------
@dataclass
class Published:
    """What ``DeltaWriter.publish`` made of a version: its kind and figures."""

    kind: str  # full | delta
    version: int
    base_version: int | None  # delta: the version it applies to
    full_version: int  # the chain's full version (itself, for a full one)
    weight_bytes: int  # the weights' files as published (the delta's, or the full ones)
    full_bytes: int  # the full version's files (what a full version would have published)
    encode_seconds: float = 0.0

    @property
    def share(self) -> float:
        return self.weight_bytes / self.full_bytes if self.full_bytes else 1.0


@dataclass
class DeltaWriter:
    """The learner's publisher of versions by delta (rank 0). It keeps the last published
    version's bytes in memory (one copy of the model, on the host) to XOR the next against."""

    full_every: int = 10
    level: int = 1
    keep_every: int = 0
    _base: dict[str, np.ndarray] | None = None
    _sums: dict[str, str] = field(default_factory=dict)
    _version: int = -1
    _full: int = -1

    def reset(self) -> None:
        """Forget the base: the next version is full."""
        self._base, self._sums, self._version, self._full = None, {}, -1, -1

    def publish(self, directory: str | Path, version: int) -> Published:
        """Turn ``directory`` (a full version as ``save_policy`` wrote it) into what is published
        for ``version``: a delta on the previous version when a reader can reconstruct it, else
        the full version with its checksums."""
        started = time.perf_counter()
        directory = Path(directory)
        files = weight_files(directory)
        if not files:
            raise DeltaError(f"{directory}: no *.safetensors files to publish")
        new = {f.name: np.fromfile(f, dtype=np.uint8) for f in files}
        sums = {name: checksum(buf) for name, buf in new.items()}
        full_bytes = sum(buf.nbytes for buf in new.values())
        base = self._base
        delta = (base is not None and self._version == version - 1 and version - self._full < self.full_every
                 and not (self.keep_every and version % self.keep_every == 0)
                 and set(base) == set(new) and all(_same_layout(base[n], new[n]) for n in new))
        manifest: dict[str, Any] = {"format": FORMAT, "version": version, "checksum": combined(sums),
                                    "files": {n: {"checksum": s, "size": int(new[n].nbytes)} for n, s in sums.items()}}
        if delta:
            assert base is not None
            written = 0
            for name in sorted(new):
                frame, table = encode(base[name], new[name], self.level)
                _write(directory / f"{name}{SUFFIX}", frame)
                manifest["files"][name]["delta"] = table
                written += len(frame)
            manifest.update(kind="delta", base_version=self._version, full_version=self._full,
                            base_checksum=combined(self._sums))
            _write(directory / MANIFEST, json.dumps(manifest).encode())
            for f in files:  # the manifest is there first: a reader never sees neither
                f.unlink()
            out = Published("delta", version, self._version, self._full, written, full_bytes)
        else:
            manifest.update(kind="full", full_version=version)
            _write(directory / MANIFEST, json.dumps(manifest).encode())
            self._full = version
            out = Published("full", version, None, version, full_bytes, full_bytes)
        self._base, self._sums, self._version = new, sums, version
        out.encode_seconds = time.perf_counter() - started
        return out


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# -- the readers' side ------------------------------------------------------------------------------
@dataclass
class Held:
    version: int
    checksum: str
    files: dict[str, np.ndarray]  # the version's weight files' bytes
    directory: Path | None = None  # its reconstructed directory (ours), once written


@dataclass
class Reconstructed:
    """One ``Reconstructor.resolve``: where the full version is, and what it took."""

    directory: Path
    applied: int = 0  # deltas applied
    from_full: bool = False  # rebuilt from the chain's full version (the base held did not fit)
    seconds: float = 0.0


Fetch = Callable[[str], Path]  # a version's URI -> a local directory of its files


class Reconstructor:
    """A process's reader of versions by delta. Per weights prefix (the directory holding the
    ``v<N>`` siblings) it holds the last version it resolved, in memory, as the base the next
    delta applies to; what it reconstructs it writes to a directory of its own under
    ``$STREAMRL_WEIGHTS_CACHE`` (default the system's temporary directory), which loads as a
    full version does (the last two are kept: a server may still be loading the one before)."""

    def __init__(self, cache: str | Path | None = None):
        self.cache = Path(cache) if cache else None
        self._held: dict[str, Held] = {}
        self._dirs: dict[str, list[Path]] = {}
        self._lock = threading.Lock()

    def _root(self) -> Path:
        base = self.cache or Path(os.environ.get("STREAMRL_WEIGHTS_CACHE") or tempfile.gettempdir()) / "streamrl-weights"
        base.mkdir(parents=True, exist_ok=True)
        return base

    def forget(self, prefix: str | None = None) -> None:
        with self._lock:
            for key in [prefix] if prefix is not None else list(self._held):
                self._held.pop(key, None)

    def held_version(self, prefix: str) -> int | None:
        held = self._held.get(prefix)
        return held.version if held else None

    def note_full(self, uri: str, directory: Path, manifest: dict[str, Any]) -> None:
        """A full version with a manifest was loaded from ``directory``: hold its bytes as the base
        for the deltas after it (checked against its checksums)."""
        prefix, version = split(uri)
        with self._lock:
            held = self._held.get(prefix)
            if held is not None and held.checksum == manifest["checksum"]:
                return
            self._held[prefix] = Held(version, manifest["checksum"], read_full(directory, manifest))

    def resolve(self, uri: str, directory: Path, manifest: dict[str, Any], fetch: Fetch) -> Reconstructed:
        """The full version ``uri`` (a delta, whose files are at ``directory``) as a local directory:
        from the base held when it is the delta's or an earlier version of its chain, else from
        the chain's full version; the deltas in between fetched with ``fetch``."""
        started = time.perf_counter()
        prefix, version = split(uri)
        with self._lock:
            try:
                out = self._resolve(prefix, version, directory, manifest, fetch)
            except Exception as exc:
                self._held.pop(prefix, None)  # what it held may be half-applied: the next try starts from full
                if isinstance(exc, DeltaError):
                    raise
                raise DeltaError(f"{uri}: {(str(exc).splitlines() or [type(exc).__name__])[0]}") from exc
        out.seconds = time.perf_counter() - started
        return out

    def _resolve(self, prefix: str, version: int, directory: Path, manifest: dict[str, Any],
                 fetch: Fetch) -> Reconstructed:
        held = self._held.get(prefix)
        if held is not None and held.checksum == manifest["checksum"] and held.directory is not None \
                and held.directory.is_dir():
            return Reconstructed(held.directory)
        full = int(manifest["full_version"])
        start = None
        if held is not None and held.checksum == manifest["base_checksum"]:
            start = version - 1
        elif held is not None and full <= held.version < version:
            held_manifest = read_manifest(fetch(sibling(prefix, held.version)))
            if held_manifest is not None and held_manifest["checksum"] == held.checksum:
                start = held.version
        out = Reconstructed(directory)
        if start is None:  # rebuild from the chain's full version
            full_dir = fetch(sibling(prefix, full))
            full_manifest = read_manifest(full_dir)
            if full_manifest is None or full_manifest.get("kind") != "full":
                raise DeltaError(f"{sibling(prefix, full)}: not the full version of the chain of v{version}")
            held = Held(full, full_manifest["checksum"], read_full(full_dir, full_manifest))
            self._held[prefix] = held
            start, out.from_full = full, True
        assert held is not None
        for k in range(start + 1, version + 1):
            step_dir = directory if k == version else fetch(sibling(prefix, k))
            step = manifest if k == version else read_manifest(step_dir)
            if step is None or step.get("kind") != "delta" or int(step["full_version"]) != full:
                raise DeltaError(f"{sibling(prefix, k)}: not a delta of the chain from v{full}")
            if step["base_checksum"] != held.checksum:
                raise DeltaError(f"{sibling(prefix, k)}: its base's checksum differs from the base held (v{held.version})")
            apply_version(held, step_dir, step)
            held.version, held.checksum, held.directory = k, step["checksum"], None
            out.applied += 1
        out.directory = self._write(prefix, version, directory, held)
        return out

    def _write(self, prefix: str, version: int, source: Path, held: Held) -> Path:
        """The reconstructed version as a directory (its files beside the weights copied from the
        delta's directory), written atomically; the ones before the previous removed."""
        tag = checksum(prefix.encode())[:12]  # (a directory named v<N>, as the version's own)
        final = self._root() / f"full-{tag}-{held.checksum[:12]}" / f"v{version}"
        if not final.is_dir():
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
            try:
                for f in source.iterdir():
                    if f.is_file() and not f.name.endswith(SUFFIX) and not f.name.startswith(".") and f.name != MANIFEST:
                        shutil.copy2(f, tmp / f.name)
                for name, buf in held.files.items():
                    buf.tofile(tmp / name)
                os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        held.directory = final
        kept = [d for d in self._dirs.get(prefix, []) if d != final] + [final]
        for old in kept[:-2]:
            shutil.rmtree(old.parent, ignore_errors=True)
        self._dirs[prefix] = kept[-2:]
        return final


def read_full(directory: Path, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    """A full version's weight files' bytes, each checked against the manifest's checksum."""
    files = {}
    for name, info in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise DeltaError(f"{path}: missing (the full version's manifest names it)")
        buf = np.fromfile(path, dtype=np.uint8)
        if checksum(buf) != info["checksum"]:
            raise DeltaError(f"{path}: checksum differs from its manifest's (a corrupt or partial file)")
        files[name] = buf
    return files


def apply_version(held: Held, directory: Path, manifest: dict[str, Any]) -> None:
    """One delta applied to the held bytes in place, each file's result checked."""
    if set(manifest["files"]) != set(held.files):
        raise DeltaError(f"{directory}: its files {sorted(manifest['files'])} differ from the base's {sorted(held.files)}")
    for name, info in manifest["files"].items():
        path = directory / f"{name}{SUFFIX}"
        if not path.is_file():
            raise DeltaError(f"{path}: missing")
        try:
            apply(held.files[name], path.read_bytes(), info["delta"])
        except Exception as exc:  # a truncated or damaged frame: zstd's own errors, or ours
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise DeltaError(f"{path}: cannot apply it ({why}; a truncated or corrupt delta)") from exc
        if checksum(held.files[name]) != info["checksum"]:
            raise DeltaError(f"{path}: the reconstructed file's checksum differs from the version's "
                             "(a corrupt delta, or a base that is not the one it names)")


def split(uri: str) -> tuple[str, int]:
    """``(prefix, N)`` of a version URI ``<prefix>/v<N>``."""
    head, _, name = uri.rstrip("/").rpartition("/")
    if not (name[:1] == "v" and name[1:].isdigit()):
        raise DeltaError(f"{uri}: a delta version's URI ends in /v<N>")
    return head, int(name[1:])


def sibling(prefix: str, version: int) -> str:
    return f"{prefix}/v{version}"


def chain_floor(manifests: dict[int, dict[str, Any] | None]) -> int | None:
    """The lowest version that the given versions' chains need (their full versions), or None."""
    fulls = [int(m.get("full_version", v)) for v, m in manifests.items() if m is not None]
    return min(fulls) if fulls else None
