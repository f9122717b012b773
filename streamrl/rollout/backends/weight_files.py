"""A policy version's weights as files here: the ``weights_uri`` the learner announced as a local
directory (downloaded first when remote), and the tensors of its safetensors files."""

from __future__ import annotations

from pathlib import Path

from streamrl.rollout.backends.base import WeightLoadError


def weights_path(uri: str) -> Path:
    """A ``weights_uri`` as a local directory: a path (optionally ``file://``) as it is; any other
    URI (``s3://``, ``gs://``, ...: ``learner.weights_uri``) downloaded first with fsspec, into a
    directory of this process that ``load_weights`` removes once loaded (``streamrl.weights_store``)."""
    from streamrl import weights_store

    if weights_store.is_remote(uri):
        try:
            return weights_store.download(uri)
        except Exception as exc:  # the filesystem's own errors (missing, denied, no s3fs ...)
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise WeightLoadError(f"weights {uri!r}: cannot download: {why}") from exc
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise WeightLoadError(f"weights {uri!r}: not a directory here")
    return path


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
