"""verl's schema as data: every leaf of verl's generated trainer configs, per engine, with verl's
default (``schema_data.py``, written by ``tools/verl_schema.py`` from the installed verl).

Why recorded rather than read at run time: verl is not a dependency (``streamrl run`` reads a verl
user's keys without verl installed), and the table of ``streamrl.verl`` must cover the whole
schema, which a test holds it to. ``read_installed_verl`` is how the data is made, and how a test
notices that the installed verl's schema moved on from the recorded one.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from streamrl.verl.schema_data import BY_ENGINE, ENGINES, SHARED, VERL_VERSION

__all__ = ["ENGINES", "VERL_VERSION", "MISSING", "verl_defaults", "schema_keys", "read_installed_verl",
           "engine_of", "DEFAULT_ENGINE"]

#: verl's mandatory value (a default of ``???``): there is no default to give
MISSING = "???"
DEFAULT_ENGINE = "dp"

#: the generated config of each engine (``model_engine=NAME``) in verl/trainer/config/
GENERATED = {"dp": "_generated_ppo_trainer.yaml", "megatron": "_generated_ppo_megatron_trainer.yaml",
             "torchtitan": "_generated_ppo_torchtitan_trainer.yaml", "veomni": "_generated_ppo_veomni_trainer.yaml"}



@lru_cache(maxsize=None)
def verl_defaults(engine: str = DEFAULT_ENGINE) -> dict[str, Any]:
    """``{key: verl's default}`` for one engine (``model_engine``), as recorded."""
    if engine not in ENGINES:
        raise KeyError(engine)
    # model_engine is no leaf of a generated config: it is the Hydra choice that picks one
    return {"model_engine": engine, **SHARED, **BY_ENGINE.get(engine, {})}


@lru_cache(maxsize=None)
def schema_keys() -> frozenset[str]:
    """Every key of every engine."""
    return frozenset().union(*(verl_defaults(e) for e in ENGINES))


def engine_of(value: Any) -> str:
    """The engine whose defaults apply: ``model_engine``'s value if it is one of verl's."""
    return value if isinstance(value, str) and value in ENGINES else DEFAULT_ENGINE


def read_installed_verl() -> tuple[str, dict[str, dict[str, Any]]]:
    """The installed verl's version and ``{engine: {key: default}}``: every leaf of its generated
    trainer configs (a list is one leaf, as Hydra overrides it whole), interpolations resolved
    where they resolve (``${oc.select:...}``, ``${trainer.project_name}``), kept as written
    where they do not, ``???`` for a mandatory value."""
    import importlib.metadata
    import importlib.util

    from omegaconf import OmegaConf

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("verl is not installed (pip install --no-deps verl)")
    base = Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config"
    out: dict[str, dict[str, Any]] = {}
    for engine, name in GENERATED.items():
        cfg = OmegaConf.load(base / name)
        leaves: dict[str, Any] = {}
        _leaves(cfg, "", leaves)
        out[engine] = leaves
    return importlib.metadata.version("verl"), out


def _leaves(node: Any, prefix: str, out: dict[str, Any]) -> None:
    from omegaconf import DictConfig, OmegaConf

    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and len(child) > 0:
            _leaves(child, path, out)
            continue
        if OmegaConf.is_missing(node, key):
            out[path] = MISSING
            continue
        try:
            value = node[key]
            out[path] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except Exception:  # an interpolation that does not resolve outside verl: as written
            out[path] = child._value()
