"""The files streamrl carries besides its code: the top-level ``topics/`` and ``configs/``.

The repository keeps them at its top level (the layout is fixed); building the package copies
them into ``streamrl/_packaged/`` (``setup.py``), so an installed streamrl finds them with
``importlib.resources`` from any directory. A source checkout (or an editable install) has no
``_packaged`` and reads them in place. No environment variable is involved.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from streamrl.errors import ConfigError

KINDS = ("topics", "configs")


def packaged_dir(kind: str) -> Path:
    """``topics`` or ``configs``: the installed copy, else the checkout's top-level directory."""
    if kind not in KINDS:
        raise ValueError(f"no packaged {kind!r}: one of {KINDS}")
    installed = resources.files("streamrl") / "_packaged" / kind
    if installed.is_dir():
        return Path(str(installed))
    return Path(__file__).resolve().parent.parent / kind


def config_names() -> list[str]:
    """The packaged pipeline configs (``local.yaml``, ``gsm8k.yaml``, ...)."""
    return sorted(p.name for p in packaged_dir("configs").glob("*.yaml"))


def resolve_config(spec: str) -> Path:
    """A pipeline config by path, else by the name of a packaged one: ``configs/local.yaml``
    in a checkout is that file; anywhere else ``local.yaml``, ``local`` or ``configs/local.yaml``
    name the packaged copy."""
    path = Path(spec)
    if path.is_file():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    packaged = packaged_dir("configs") / name
    if (not path.parent.parts or path.parent == Path("configs")) and packaged.is_file():
        return packaged
    raise ConfigError(f"config file not found: {spec!r} (packaged configs: {', '.join(config_names())})")
