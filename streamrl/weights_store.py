"""Policy weights by URI (``learner.weights_uri``), for rollout workers on other nodes.

The learner writes each version to its local ``learner.weights_dir`` as always; with
``learner.weights_uri`` set (``s3://bucket/run``, ``gs://...``, ``file:///shared/run``, any
filesystem fsspec knows) it also uploads the version's directory to ``<weights_uri>/v<N>/`` and
announces that URI on ``streamrl.policy``, only once the upload is complete. A rollout worker
loads a local path (or ``file://``) in place, and downloads any other URI into a directory of its
own (``$STREAMRL_WEIGHTS_CACHE``, default the system's temporary directory), removed as soon as
the version is loaded.

fsspec comes with torch (the ``cpu``/``gpu`` extras) and with the ``ray`` extra; ``s3://`` needs
``s3fs`` and ``gs://`` ``gcsfs`` where the stages run. Credentials come from the environment
(``AWS_ACCESS_KEY_ID`` ...): under Ray, name them in ``run.ray.env_vars``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from streamrl.errors import ConfigError, need

_downloads: dict[str, Path] = {}  # uri -> the local copy being loaded
_lock = threading.Lock()


def is_remote(uri: str) -> bool:
    """Anything but a local path or a ``file://`` URI: it is downloaded before loading."""
    return "://" in uri and not uri.startswith("file://")


def version_uri(prefix: str, version: int) -> str:
    return f"{prefix.rstrip('/')}/v{version}"


def _fs(uri: str) -> tuple[Any, str]:
    fsspec = need("fsspec", "ray", f"weights at {uri.split('://', 1)[0]}://")
    return fsspec.core.url_to_fs(uri)


def check_uri(uri: str, field: str = "learner.weights_uri") -> None:
    """A URI with a scheme whose fsspec filesystem is installed; else a ``ConfigError`` naming
    ``field`` and what to install."""
    if "://" not in uri:
        raise ConfigError(f"config field {field!r}: {uri!r} is not a URI (s3://BUCKET/PATH, gs://..., "
                          f"file:///shared/dir); a local directory is learner.weights_dir")
    protocol = uri.split("://", 1)[0]
    fsspec = need("fsspec", "ray", f"config field {field!r}")
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError(f"config field {field!r}: fsspec knows no filesystem {protocol!r}") from None
    except ImportError as exc:
        raise ConfigError(f"config field {field!r}: {protocol}:// needs a package: "
                          f"{str(exc).splitlines()[0]}") from None


def upload(local_dir: Path, uri: str) -> str:
    """Copy the files of ``local_dir`` to ``uri`` (what was there is replaced: a learner that
    starts a new line re-announces a version); returns ``uri``."""
    fs, root = _fs(uri)
    root = root.rstrip("/")
    if fs.exists(root):
        fs.rm(root, recursive=True)
    for file in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
        target = f"{root}/{file.relative_to(local_dir).as_posix()}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(file), target)
    return uri


def prune(prefix: str, version: int, keep: int, keep_every: int = 0) -> None:
    """Remove ``<prefix>/v<N>`` for N <= version - keep (the newest ``keep`` stay), except the
    multiples of ``keep_every``."""
    fs, root = _fs(prefix)
    root = root.rstrip("/")
    if not fs.exists(root):
        return
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name[:1] == "v" and name[1:].isdigit() and int(name[1:]) <= version - keep:
            if not (keep_every and int(name[1:]) % keep_every == 0):
                fs.rm(entry, recursive=True)


def download(uri: str) -> Path:
    """A local copy of the directory at ``uri``, for loading; ``release(uri)`` removes it."""
    fs, root = _fs(uri)
    root = root.rstrip("/")
    files = [f for f in fs.find(root) if not f.rstrip("/").rsplit("/", 1)[-1].startswith(".")]
    if not files:
        raise FileNotFoundError(f"nothing at {uri}")
    base = Path(os.environ.get("STREAMRL_WEIGHTS_CACHE") or tempfile.gettempdir()) / "streamrl-weights"
    base.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix=f"{root.rsplit('/', 1)[-1]}-", dir=base))
    try:
        for f in files:
            local = target / f[len(root):].lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f, str(local))
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    with _lock:
        old = _downloads.pop(uri, None)
        _downloads[uri] = target
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def release(uri: str) -> None:
    """Remove the local copy ``download(uri)`` made, if any (the weights are loaded by then)."""
    with _lock:
        path = _downloads.pop(uri, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
