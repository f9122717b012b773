"""verl's own agent loops (``single_turn_agent_loop.py``, ``tool_agent_loop.py`` of the installed
wheel), for the tests. Where verl's agent loop imports (verl with Ray, Hydra and tensordict) they
are verl's classes as verl registers them. Where it does not (verl installed ``--no-deps``, as on
the project's machines: ``verl/__init__`` needs tensordict), verl's two files are loaded from the
wheel with the names they import resolved to streamrl's copies of verl's API (``AgentLoopBase``,
``AgentLoopOutput``, ``register``, ``TokenOutput``: ``streamrl.rollout.agent_loops.base``) and to
verl's own files that need nothing more (``tools/schemas.py``, ``tools/function_tool.py``,
``experimental/agent_loop/tool_parser.py``); the stand-ins are removed from ``sys.modules`` once
the files are loaded. The loops' code is verl's, unchanged. None: verl is not installed at all."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import sys
import time
import types
from pathlib import Path
from typing import Any


def _verl_root() -> Path | None:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # every stand-in is a package: a submodule can be put below it
    m.__dict__.update(attrs)
    return m


def _from_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _simple_timer(name: str, timing: dict[str, float]):
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _event_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.get_event_loop()


def load() -> tuple[type, type, str] | None:
    """``(SingleTurnAgentLoop, ToolAgentLoop, how)``: verl's two loops and how they were loaded."""
    root = _verl_root()
    if root is None:
        return None
    try:
        mod = importlib.import_module("verl.experimental.agent_loop")
        return mod.SingleTurnAgentLoop, mod.ToolAgentLoop, "verl"
    except Exception:  # noqa: BLE001 - verl without its dependencies: its files on streamrl's base
        pass
    from streamrl.rollout.agent_loops import base

    saved_registry = dict(base._agent_loop_registry)
    ours = {
        "verl": _module("verl"), "verl.experimental": _module("verl.experimental"),
        "verl.experimental.agent_loop": _module("verl.experimental.agent_loop"),
        "verl.experimental.agent_loop.agent_loop": base,
        "verl.utils": _module("verl.utils"),
        "verl.utils.profiler": _module("verl.utils.profiler", simple_timer=_simple_timer),
        "verl.utils.rollout_trace": _module("verl.utils.rollout_trace", rollout_trace_op=lambda fn: fn),
        "verl.utils.ray_utils": _module("verl.utils.ray_utils", get_event_loop=_event_loop),
        "verl.workers": _module("verl.workers"), "verl.workers.rollout": _module("verl.workers.rollout"),
        "verl.workers.rollout.replica": _module("verl.workers.rollout.replica", TokenOutput=base.TokenOutput),
        "verl.tools": _module("verl.tools"),
    }
    before = {k: sys.modules.get(k) for k in [*ours, "verl.tools.schemas", "verl.tools.function_tool",
                                               "verl.experimental.agent_loop.tool_parser"]}
    try:
        sys.modules.update(ours)
        _from_file("verl.tools.schemas", root / "tools" / "schemas.py")
        _from_file("verl.tools.function_tool", root / "tools" / "function_tool.py")
        _from_file("verl.experimental.agent_loop.tool_parser", root / "experimental" / "agent_loop" / "tool_parser.py")
        single = _from_file("streamrl_test_verl_single_turn_agent_loop",
                            root / "experimental" / "agent_loop" / "single_turn_agent_loop.py")
        tool = _from_file("streamrl_test_verl_tool_agent_loop", root / "experimental" / "agent_loop" / "tool_agent_loop.py")
    finally:
        for k, v in before.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        base._agent_loop_registry.clear()  # verl's files registered their built-in names: not ours
        base._agent_loop_registry.update(saved_registry)
    return single.SingleTurnAgentLoop, tool.ToolAgentLoop, "verl's files on streamrl's base"
