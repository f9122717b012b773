"""verl's interaction config files (``rollout.multi_turn.interaction_config_path``), read the way
verl's ``interaction_registry`` reads them, and the helpers the tool config shares:

    interaction:
      - name: gsm8k                                               # what samples name
        class_name: streamrl.rollout.interactions.gsm8k.Gsm8kInteraction
        config: {method: strict}                                  # Class(config={..., "name": name})

``class_name`` is verl's dotted ``package.module.Class``; streamrl's ``package.module:Class`` and
``path/to/file.py:Class`` (relative to the working directory, else to the config file) load too,
all through ``streamrl.loading.load_object``. verl's own shipped classes
(``verl.interactions.gsm8k_interaction.Gsm8kInteraction``, ``verl.tools.gsm8k_tool.Gsm8kTool``)
load from verl when it is installed (and imports), else as streamrl's equivalents, so verl's example configs
run as they are. A missing ``name`` is derived as verl derives it (``FooInteraction`` ->
``foo``); two entries with one name are an error. Every problem is a ``ConfigError`` naming the
config field and the entry.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from streamrl.errors import ConfigError
from streamrl.loading import load_object

#: verl's shipped classes -> (streamrl's equivalent, config defaults that give verl's behaviour),
#: used only when verl is not installed.
VERL_EQUIVALENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction":
        ("streamrl.rollout.interactions.gsm8k:Gsm8kInteraction", {"method": "strict"}),
    "verl.tools.gsm8k_tool.Gsm8kTool": ("streamrl.rollout.tools.gsm8k:Gsm8kTool", {}),
}

_INTERACTION_KEYS = {"name", "class_name", "config"}

log = logging.getLogger(__name__)


def resolve_config_file(path: str, field: str) -> Path:
    """``path`` as given when it is a file, else relative to the packaged ``configs/``
    (``interaction_config/gsm8k.yaml`` names the copy streamrl ships)."""
    from streamrl.packaged import packaged_dir

    given = Path(path).expanduser()
    if given.is_file():
        return given.resolve()
    if not given.is_absolute():
        for base in (packaged_dir("configs"), packaged_dir("configs").parent):
            candidate = base / given
            if candidate.is_file():
                return candidate.resolve()
    raise ConfigError(f"config field {field!r}: no file {path!r} (nor under the packaged configs/)")


def read_entries(path: Path, key: str, field: str) -> list[dict[str, Any]]:
    """The list under ``key`` of YAML file ``path``, each entry a mapping (resolved as verl's
    OmegaConf loading resolves ``${...}``)."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ConfigError(f"config field {field!r}: {path}: {str(exc).splitlines()[0]}") from None
    entries = data.get(key) if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"config field {field!r}: {path}: wants a list under {key!r}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"config field {field!r}: {path}: {key}[{i}] is not a mapping")
    return entries


@functools.lru_cache(maxsize=None)
def verl_installed() -> bool:
    """verl imports here (installed with its dependencies). A verl that is present but cannot
    import (installed without its dependencies) counts as absent: its classes could not load."""
    if importlib.util.find_spec("verl") is None:
        return False
    try:
        importlib.import_module("verl")
    except Exception as exc:  # noqa: BLE001 - any failure to import means: not usable
        log.warning("verl is installed but does not import (%s: %s): using streamrl's equivalents of its "
                    "classes", type(exc).__name__, exc)
        return False
    return True


def load_class(class_name: str, field: str, config_dir: Path | None = None) -> tuple[type, dict[str, Any]]:
    """The class ``class_name`` names (see the module doc) and the config defaults its verl
    equivalent needs (empty unless one was substituted)."""
    if not isinstance(class_name, str) or not class_name:
        raise ConfigError(f"config field {field!r}: class_name is required")
    defaults: dict[str, Any] = {}
    ref = class_name
    if ref in VERL_EQUIVALENTS and not verl_installed():
        ref, defaults = VERL_EQUIVALENTS[ref]
    if ":" not in ref:
        if "." not in ref:
            raise ConfigError(f"config field {field!r}: {class_name!r} is not 'package.module.Class', "
                              "'package.module:Class' or 'file.py:Class'")
        ref = ":".join(ref.rsplit(".", 1))
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py") and not Path(target).is_absolute():
        here = Path(target)
        if not here.is_file() and config_dir is not None and (config_dir / target).is_file():
            ref = f"{(config_dir / target).resolve()}:{attr}"
    cls = load_object(ref, field, "class")
    if not inspect.isclass(cls):
        raise ConfigError(f"config field {field!r}: {class_name!r} is not a class")
    return cls, defaults


def load_interaction_config(path: str, field: str = "rollout.multi_turn.interaction_config_path") -> dict[str, Any]:
    """name -> interaction object, for every entry of the interaction config at ``path``."""
    file = resolve_config_file(path, field)
    out: dict[str, Any] = {}
    for i, entry in enumerate(read_entries(file, "interaction", field)):
        where = f"{field}: {file}: interaction[{i}]"
        unknown = set(entry) - _INTERACTION_KEYS
        if unknown:
            raise ConfigError(f"config field {where!r}: unknown keys {sorted(unknown)} "
                              f"(an entry has {sorted(_INTERACTION_KEYS)})")
        cls, defaults = load_class(entry.get("class_name", ""), f"{where}.class_name", file.parent)
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"config field '{where}.config': must be a mapping")
        name = entry.get("name")
        if name is None:
            simple = entry["class_name"].replace(":", ".").rsplit(".", 1)[-1]
            name = simple[:-len("Interaction")].lower() if simple.endswith("Interaction") else simple.lower()
        if not isinstance(name, str) or not name:
            raise ConfigError(f"config field '{where}.name': must be a non-empty string")
        if name in out:
            raise ConfigError(f"config field '{where}.name': duplicate interaction name {name!r}")
        out[name] = construct(cls, f"{where} ({name})", config={**defaults, **config, "name": name})
        check_methods(out[name], ("start_interaction", "generate_response", "finalize_interaction"),
                      f"{where} ({name})")
    if not out:
        raise ConfigError(f"config field {field!r}: {file}: no interactions")
    return out


def construct(cls: type, where: str, **kwargs: Any) -> Any:
    """``cls(**kwargs)``; a constructor that fails is a config error naming the entry."""
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a user's constructor: any failure, named
        raise ConfigError(f"config field {where!r}: {cls.__name__} failed to start: "
                          f"{type(exc).__name__}: {exc}") from None


def check_methods(obj: Any, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if not callable(getattr(obj, n, None))]
    if missing:
        raise ConfigError(f"config field {where!r}: {type(obj).__name__} has no {', '.join(missing)}")


def call_compat(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with only what ``fn``'s signature accepts. verl's loops pass
    keywords a user's method may not declare (the sample's ``interaction_kwargs``,
    ``create_kwargs``), and verl's ``BaseInteraction.finalize_interaction`` takes no
    ``instance_id`` at all; a method with ``**kwargs`` gets everything. Errors raised inside
    ``fn`` are not touched."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        args = args[:len(positional)]
    bound = {p.name for p in positional[:len(args)]}
    kwargs = {k: v for k, v in kwargs.items() if k not in bound}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return fn(*args, **kwargs)
