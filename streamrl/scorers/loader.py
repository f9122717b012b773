"""User scorers: loading them, checking their signature at start, and running them.

A user scorer is a function with verl's signature (DESIGN.md), sync or async, named as
``path/to/file.py:name`` or ``package.module:name``. ``FunctionScorer`` wraps one so the stage sees
every scorer the same way (an async callable with ``start`` / ``close`` / ``set_share``):

- the signature is checked when the stage starts, not on the first record: it must take
  ``data_source, solution_str, ground_truth, extra_info`` plus the configured ``kwargs``, and a
  function whose ``reward_router_address`` has no default fails when no reward router is
  configured;
- async functions run on the event loop (they are I/O: they call a reward server);
- sync functions run where the config says: inline (cheap rules), in a thread, or in a worker
  process with a per-record timeout (pebble kills the worker that overruns and starts a fresh
  one), so CPU-heavy checks neither block the loop nor serialise on the GIL. The worker
  resolves the function from its reference string itself: nothing but plain arguments and
  results crosses the process boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Callable

from streamrl.errors import ConfigError
from streamrl.scorers.base import ScoreError

#: Keyword arguments the stage may offer a scorer beyond verl's four; a function gets the ones
#: it names (or all, if it takes ``**kwargs``).
OPTIONAL_KWARGS = ("reward_router_address", "reward_model_tokenizer", "prompt")


@functools.lru_cache(maxsize=None)
def load_function(ref: str) -> Callable[..., Any]:
    """``file.py:name`` (a path, relative to the working directory) or ``module:name``."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"scorer reference {ref!r}: expected 'file.py:name' or 'module:name'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ConfigError(f"scorer reference {ref!r}: no file {path}")
        mod_name = f"streamrl_user_scorer_{abs(hash(str(path)))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"scorer reference {ref!r}: cannot import {target}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"scorer reference {ref!r}: {target} has no function {attr!r}")
    return fn


def module_version(fn: Callable[..., Any]) -> str:
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    return str(getattr(module, "VERSION", None) or getattr(module, "__version__", None) or "0")


def check_signature(fn: Callable[..., Any], where: str, kwargs: dict[str, Any],
                    available: dict[str, Any]) -> set[str]:
    """Fail now if ``fn`` cannot be called as a scorer; return which of ``OPTIONAL_KWARGS`` it
    takes. ``available`` maps an optional keyword to its value, or None where none is
    configured."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read the signature of {fn!r}: {exc}") from None
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    takes = {k for k in OPTIONAL_KWARGS if k in params or var_kw}
    # A required optional keyword with nothing configured to give it: fail at start.
    for name in takes & set(params):
        if params[name].default is params[name].empty and available.get(name) is None:
            hint = (" (no reward model is configured: set reward.reward_router to a judge entry "
                    "or HOST:PORT)" if name == "reward_router_address" else "")
            raise ConfigError(f"{where}: {fn.__name__} requires {name!r}{hint}")
    offered = {k: available.get(k) for k in takes if available.get(k) is not None}
    try:
        sig.bind(data_source="d", solution_str="s", ground_truth="g", extra_info={},
                 **kwargs, **offered)
    except TypeError as exc:
        raise ConfigError(
            f"{where}: {fn.__name__}{sig} does not take verl's scorer arguments "
            f"(data_source, solution_str, ground_truth, extra_info=None, **kwargs) with the "
            f"configured kwargs {sorted(kwargs)}: {exc}") from None
    return takes


# -- worker processes ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str) -> Any:
    """verl's ``reward_model_tokenizer``: a Hugging Face tokenizer by hub id or directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _call_in_worker(ref: str, kwargs: dict[str, Any], tokenizer: str = "") -> Any:
    """Runs in a worker process: resolve the function (and the tokenizer, by name) once per
    worker, then call it. A tokenizer is never shipped per record."""
    if tokenizer:
        kwargs["reward_model_tokenizer"] = load_tokenizer(tokenizer)
    return load_function(ref)(**kwargs)


class ProcessRunner:
    """A pool of worker processes (pebble) for sync scorers, shared by every entry that uses one.
    Workers are forked: a fork server or spawn would re-run the parent's ``__main__`` in every
    worker, and a service script's ``__main__`` starts a whole stage. A forked worker only runs
    ``_call_in_worker``; it never touches the parent's event loop or Kafka connections."""

    def __init__(self, workers: int = 0):
        self.workers = workers or os.cpu_count() or 1
        self._pool = None

    def start(self) -> None:
        if self._pool is None:
            import pebble

            self._pool = pebble.ProcessPool(max_workers=self.workers,
                                            context=multiprocessing.get_context("fork"))

    async def call(self, ref: str, kwargs: dict[str, Any], timeout_s: float,
                   tokenizer: str = "") -> Any:
        self.start()
        future = self._pool.schedule(_call_in_worker, args=(ref, kwargs, tokenizer),
                                     timeout=timeout_s if timeout_s > 0 else None)
        try:
            return await asyncio.wrap_future(future)
        except concurrent.futures.TimeoutError:
            raise ScoreError("timeout", f"{ref} ran over {timeout_s} s in its worker process "
                                        "(the worker was killed)") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=5)
            self._pool = None


class FunctionScorer:
    """A verl-signature function as a table entry's async scorer."""

    def __init__(self, ref: str, *, name: str, kwargs: dict[str, Any] | None = None,
                 executor: str = "inline", timeout_s: float = 30.0,
                 available: dict[str, Any] | None = None, runner: ProcessRunner | None = None,
                 version: str = "", tokenizer_name: str = ""):
        self.ref, self.name = ref, name
        where = f"config field 'reward.scorers.{name}"
        try:
            self.fn = load_function(ref)
        except ConfigError as exc:
            raise ConfigError(f"{where}.path': {exc}") from None
        self.kwargs = dict(kwargs or {})
        self.is_async = inspect.iscoroutinefunction(self.fn)
        if self.is_async and executor not in ("auto", "inline"):
            raise ConfigError(f"{where}.executor': {ref} is async; it runs on the event loop, "
                              f"not in a {executor}")
        self.executor = "inline" if executor == "auto" and self.is_async else executor
        if self.executor == "auto":
            self.executor = "process"
        if self.executor == "process" and runner is None:
            raise ValueError("executor=process needs a ProcessRunner")
        self.runner, self.timeout_s = runner, timeout_s
        self.available = dict(available or {})
        self.tokenizer_name = tokenizer_name
        self.takes = check_signature(self.fn, f"{where}.path'", self.kwargs, self.available)
        self.version = version or module_version(self.fn)

    async def start(self) -> None:
        """Nothing to start: the shared process pool starts on its first call, so a member that
        never sees a record for a process scorer never forks workers."""

    async def close(self) -> None:
        """The process pool is shared: its owner closes it."""

    def set_share(self, fraction: float) -> None:
        """A function has no group-wide limits of its own."""

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict[str, Any] | None = None, **offered: Any) -> Any:
        call = dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                    extra_info=extra_info, **self.kwargs)
        for key in self.takes:
            value = offered.get(key, self.available.get(key))
            if value is not None:
                call[key] = value
        timeout = self.timeout_s if self.timeout_s > 0 else None
        if self.is_async:
            return await self._bounded(self.fn(**call), timeout)
        if self.executor == "process":
            assert self.runner is not None
            # the worker loads the tokenizer by name: an object per record would cost megabytes
            tokenizer = self.tokenizer_name if call.pop("reward_model_tokenizer", None) is not None else ""
            return await self.runner.call(self.ref, call, self.timeout_s, tokenizer)
        if self.executor == "thread":
            return await self._bounded(asyncio.to_thread(functools.partial(self.fn, **call)), timeout)
        return self.fn(**call)

    async def _bounded(self, awaitable: Any, timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            raise ScoreError("timeout", f"{self.ref} ran over {timeout} s") from None
