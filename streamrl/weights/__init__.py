"""A policy version's files, in one place: written (``save_policy``, atomically), published by URI
(``upload``, ``prune``), fetched and read where a rollout backend loads them (``weights_path``,
``iter_safetensors``), and exported as a Hugging Face directory (``export_version``).

By URI (``learner.weights_uri``), for rollout workers on other nodes:

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

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from streamrl.errors import ConfigError, StreamrlError, need
from streamrl.policy import load_policy
from streamrl.weights import delta

log = logging.getLogger(__name__)

_downloads: dict[str, Path] = {}  # uri -> the local copy being loaded
_lock = threading.Lock()
reconstructor = delta.Reconstructor()  # this process's bases of versions published by delta


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
    starts a new line re-announces a version); returns ``uri``. The manifest goes last: it is the
    version's commit marker (``incomplete``), so an upload cut anywhere leaves a directory every
    reader refuses, never one it reads as whole."""
    fs, root = _fs(uri)
    root = root.rstrip("/")
    if fs.exists(root):
        fs.rm(root, recursive=True)
    files = sorted(p for p in Path(local_dir).rglob("*") if p.is_file())
    for file in sorted(files, key=lambda p: p.name == delta.MANIFEST):
        target = f"{root}/{file.relative_to(local_dir).as_posix()}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(file), target)
    return uri


def prune(prefix: str, version: int, keep: int, keep_every: int = 0) -> None:
    """Remove ``<prefix>/v<N>`` for N <= version - keep (the newest ``keep`` stay), except the
    multiples of ``keep_every`` and the versions a kept delta is rebuilt from (its chain, from
    its full version on: ``streamrl.weights.delta``). ``prefix``: a path or any fsspec URI."""
    fs, root = _fs(prefix) if "://" in prefix else _fs(f"file://{Path(prefix).resolve()}")
    root = root.rstrip("/")
    if not fs.exists(root):
        return
    found: dict[int, str] = {}
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name[:1] == "v" and name[1:].isdigit():
            found[int(name[1:])] = entry
    kept = [n for n in found if n > version - keep or (keep_every and n % keep_every == 0)]
    floors = {}
    for n in kept:  # a full version's manifest names itself; a delta's, its chain's full version
        path = f"{found[n].rstrip('/')}/{delta.MANIFEST}"
        try:
            floors[n] = json.loads(fs.cat_file(path)) if fs.exists(path) else None
        except (OSError, ValueError):
            floors[n] = None
    needed: set[int] = set()
    for n, manifest in floors.items():
        if manifest is not None and manifest.get("kind") == "delta":
            needed.update(range(int(manifest["full_version"]), n))
    for n, entry in found.items():
        if n <= version - keep and not (keep_every and n % keep_every == 0) and n not in needed:
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


class WeightLoadError(StreamrlError):
    """A policy version's weights could not be loaded: one line naming the version, the file and
    what is wrong. A rollout worker keeps the weights it has and tries again; ``streamrl
    export`` and a teacher's start print it and exit non-zero."""


#: What a version's weights are written as, without a manifest (``save_policy``; a LoRA adapter).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def incomplete(directory: str | Path) -> str | None:
    """Why the version directory is not whole, in a sentence naming the file, or None when it is.

    The manifest (``streamrl.weights.delta.MANIFEST``) is written last, by the learner and by
    ``upload``, and read first: where it is, every file it names must be there, at its size for a
    full version (the checksums are checked when the files are read); a delta's file without its
    manifest is a version whose write or upload was cut. A directory without a manifest and
    without a delta's file is a full version as written before manifests, or without
    ``learner.weights_delta``: whole if it has its weights."""
    directory = Path(directory)
    manifest_path = directory / delta.MANIFEST
    if manifest_path.is_file():
        try:
            manifest = delta.read_manifest(directory)
            files = manifest["files"]  # type: ignore[index]
            kind = manifest.get("kind", "full")  # type: ignore[union-attr]
        except (OSError, ValueError, TypeError, KeyError, AttributeError, delta.DeltaError) as exc:
            return f"{manifest_path}: unreadable manifest ({_first_line(exc)})"
        for name, info in sorted(files.items()):
            if kind == "delta":
                path = directory / f"{name}{delta.SUFFIX}"
                if not path.is_file():
                    return f"{path}: missing (the delta's manifest names it)"
                continue
            path = directory / name
            if not path.is_file():
                return f"{path}: missing (the manifest names it)"
            size = path.stat().st_size
            if "size" in info and size != int(info["size"]):
                return f"{path}: {size} bytes, its manifest says {int(info['size'])} (a truncated or partial file)"
        return None
    cut = sorted(directory.glob(f"*{delta.SUFFIX}"))
    if cut:
        return (f"{cut[0]}: a delta without its manifest {delta.MANIFEST} (its write or upload was cut "
                f"before the manifest, which is written last)")
    if not any(any(directory.glob(p)) for p in WEIGHT_PATTERNS):
        return f"{directory}: no weights files ({', '.join(WEIGHT_PATTERNS)}) and no manifest"
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# -- writing a version -------------------------------------------------------------------------
def without_tied_copies(model: Any, state_dict: dict) -> dict:
    """``state_dict`` without the names under which ``model`` holds a parameter a second time
    (``lm_head.weight`` of a tied embedding). A state dict gathered from FSDP2 shards has a
    separate tensor per name, so ``save_pretrained`` cannot see the tie and would write the
    weight twice: the file would depend on the rank count that wrote it."""
    first = {name for name, _ in model.named_parameters()}  # one name per parameter
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first
    return {k: v for k, v in state_dict.items() if k not in aliases}


def save_policy(model: Any, tokenizer: Any, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write weights (safetensors), config and tokenizer to ``directory``, atomically: into a
    sibling temporary directory, then renamed, so a reader never sees half a version.
    ``state_dict``: the weights to write instead of ``model``'s (a sharded model's, gathered)."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if state_dict is not None:
        state_dict = without_tied_copies(model, state_dict)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


# -- published versions as Hugging Face directories (``streamrl export``) -------------------------
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: a directory holding a LoRA adapter (learner.lora)


def version_dirs(run_dir: str | Path) -> tuple[Path, dict[int, Path]]:
    """The weights directory of a run (``RUN/weights``, ``RUN/learner/weights``, or the weights
    directory itself) and its published versions (``v<N>``) by number, whole or not
    (``newest_whole`` picks among them)."""
    root = Path(run_dir)
    for weights in (root / "weights", root / "learner" / "weights", root):
        found = {int(p.name[1:]): p for p in weights.glob("v*") if p.name[1:].isdigit() and p.is_dir()}
        if found:
            return weights, found
    raise FileNotFoundError(f"{run_dir}: no published versions (v<N>/) in it, in weights/ or in learner/weights/")


def newest_whole(versions: dict[int, Path]) -> tuple[int | None, dict[int, str]]:
    """The newest version whose directory is whole (``incomplete``), and why each newer one was
    passed over (a version still being written, or one whose write was cut)."""
    skipped: dict[int, str] = {}
    for n in sorted(versions, reverse=True):
        why = incomplete(versions[n])
        if why is None:
            return n, skipped
        skipped[n] = why
    return None, skipped


def export_version(src: str | Path, out: str | Path, merge: bool = False, base: str | Path | None = None) -> Path:
    """Write version directory ``src`` as a Hugging Face directory at ``out`` that
    ``AutoModelForCausalLM.from_pretrained(out)`` loads as is: full weights as they are; a LoRA
    adapter (``base``: the base it applies to) as PEFT's files naming that base, or with
    ``merge`` the base with the adapter merged in (PEFT's ``merge_and_unload``), and the
    tokenizer. A version published as a delta is rebuilt from its chain first (its siblings)."""
    src, out = Path(src), Path(out)
    why = incomplete(src)
    if why is not None:
        raise WeightLoadError(f"version {src.name} is not whole: {why}")
    if not (src / ADAPTER_CONFIG).is_file():
        if (src / delta.MANIFEST).is_file():
            src = weights_path(str(src.resolve()))  # the full version, bit-exact
        shutil.copytree(src, out, dirs_exist_ok=True,  # full weights (merge: nothing to merge)
                        ignore=shutil.ignore_patterns(delta.MANIFEST))
        return out
    if base is None or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"{src} is a LoRA adapter, but its base ({base}) has no config.json")
    base = Path(base).resolve()

    _, tokenizer = load_policy(str(base))
    if merge:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype="auto")
        merged = PeftModel.from_pretrained(model, str(src)).merge_and_unload()
        merged.save_pretrained(out, safe_serialization=True)
    else:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "adapter_model.safetensors", out / "adapter_model.safetensors")
        config = json.loads((src / ADAPTER_CONFIG).read_text())
        config["base_model_name_or_path"] = str(base)  # where transformers finds the base
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    return out


# -- reading a version here (the rollout backends) ---------------------------------------------
def weights_path(uri: str) -> Path:
    """A ``weights_uri`` as a local directory of full weights: a path (optionally ``file://``) as
    it is; any other URI (``s3://``, ``gs://``, ...: ``learner.weights_uri``) downloaded first
    with fsspec, into a directory of this process that ``load_weights`` removes once loaded
    (``download``). A version published as a delta (``learner.weights_delta``) is reconstructed,
    bit-exact, from the base this process holds or from its chain's full version
    (``streamrl.weights.delta``); a corrupt or missing file fails here, naming it."""
    local = _fetch(uri)
    why = incomplete(local)  # the manifest first: a version is read only once it is whole
    if why is not None:
        if is_remote(uri):
            release(uri)
        raise WeightLoadError(f"weights {uri!r}: not whole: {why}")
    manifest = delta.read_manifest(local)
    if manifest is None:
        return local
    if manifest.get("kind") != "delta":
        try:
            reconstructor.note_full(_as_uri(uri), local, manifest)
        except (OSError, delta.DeltaError) as exc:
            raise WeightLoadError(f"weights {uri!r}: {exc}") from exc
        return local
    fetched: list[str] = []

    def fetch(version_uri: str) -> Path:  # another version of the chain
        fetched.append(version_uri)
        try:
            return _locate(version_uri)
        except _Unreachable as exc:
            raise delta.DeltaError(f"{version_uri}, which its chain needs: {exc}") from exc.__cause__

    from streamrl import metrics

    try:
        out = reconstructor.resolve(_as_uri(uri), local, manifest, fetch)
    except delta.DeltaError as exc:
        metrics.WEIGHTS_RECONSTRUCT_FAILURES.inc()
        raise WeightLoadError(f"weights {uri!r}: cannot reconstruct the delta: {exc}") from exc
    finally:
        for u in (uri, *fetched):
            if u != uri or is_remote(uri):
                release(u)
    metrics.WEIGHTS_RECONSTRUCT_SECONDS.observe(out.seconds)
    log.info("weights %s: reconstructed from %d delta(s)%s in %.2f s", uri, out.applied,
             " after the chain's full version" if out.from_full else "", out.seconds)
    return out.directory


def local_policy(spec: str) -> str:
    """A policy spec as ``load_policy`` reads it: a version a learner published by delta (the
    teacher's model may be one) rebuilt from its chain first; anything else as it is."""
    path = Path(spec.removeprefix("file://"))
    if spec != "tiny" and ((path / delta.MANIFEST).is_file() or any(path.glob(f"*{delta.SUFFIX}"))):
        return str(weights_path(str(path.resolve())))  # a version by delta, or one cut short: refused
    return spec


def _as_uri(uri: str) -> str:
    """The key a version's chain is held under: its URI as announced, a path absolute."""
    if is_remote(uri):
        return uri.rstrip("/")
    return str(Path(uri.removeprefix("file://")).resolve())


class _Unreachable(Exception):
    """A version's directory cannot be had here (its message says why, in a few words)."""


def _locate(uri: str) -> Path:
    if is_remote(uri):
        try:
            return download(uri)
        except Exception as exc:  # the filesystem's own errors (missing, denied, no s3fs ...)
            raise _Unreachable(f"cannot download: {_first_line(exc)}") from exc
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise _Unreachable("not a directory here (missing)")
    return path


def _fetch(uri: str) -> Path:
    """One version's files here, as they are (a path, or a download)."""
    try:
        return _locate(uri)
    except _Unreachable as exc:
        raise WeightLoadError(f"weights {uri!r}: {exc}") from exc.__cause__


def iter_safetensors(directory: Path):
    """``(name, tensor)`` of every ``*.safetensors`` file in ``directory`` (safetensors holds
    only tensors: nothing in it is executed)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{directory}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
