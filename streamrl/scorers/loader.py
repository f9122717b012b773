"""User scorers: loading them, checking their signature at start, and running them.

A user scorer is a function with verl's signature (docs/contracts.md), sync or async, named as
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
import concurrent.futures.process
import functools
import inspect
import logging
import multiprocessing
import os
import resource
import signal
import sys
import threading
from typing import Any, Callable

from streamrl.errors import ConfigError, Failure
from streamrl.loading import load_object
from streamrl.scorers.batching import MicroBatcher

#: Keyword arguments the stage may offer a scorer beyond verl's four; a function gets the ones
#: it names (or all, if it takes ``**kwargs``).
OPTIONAL_KWARGS = ("reward_router_address", "reward_model_tokenizer", "prompt")

log = logging.getLogger(__name__)


def load_function(ref: str) -> Callable[..., Any]:
    """A scorer function by ``file.py:name`` or ``module:name`` (``streamrl.loading``)."""
    return load_object(ref, "scorer reference", "function")


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


def address_space_bytes() -> int | None:
    """This process's virtual address space (``VmSize``), or None where ``/proc`` has none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def _worker_init(memory_mb: int) -> None:
    """First thing in every forked worker. A fork inherits the member's signal handling: its
    SIGTERM/SIGINT handlers and asyncio's wake-up fd (``signal.set_wakeup_fd``), which is the
    write end of the member's own event loop. Left so, the SIGTERM that pebble sends a worker
    past its timeout would be written into the member's loop and stop the whole member. So: the
    default handlers back, no wake-up fd, and an address-space cap so a runaway computation
    (a SymPy comparison that grows without end) fails in its worker, not on the machine.

    The cap is ``memory_mb`` *more than the address space the worker inherits*. A fork starts
    with all of the member's mappings: every thread's stack and malloc arena (a Kafka client
    holds about 190 MB of them), torch's libraries, CUDA's reservations (tens of GB). An
    absolute cap was the cause of scorer workers dying under load: once the member had grown
    near 4 GB, a new worker was born at its cap: an allocation that failed inside math-verify's
    parse was read as "cannot parse" (``bad_ground_truth`` for ``\\frac{1}{2}``: the scorer
    caught every ``Exception``, ``MemoryError`` too), and one outside the scorer ended the
    worker ("Abnormal termination"), on every retry: each fresh worker was forked as large."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    inherited = address_space_bytes()
    if memory_mb > 0 and inherited is not None:  # no /proc (macOS): RLIMIT_AS is not enforced there
        cap = inherited + memory_mb * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


class ProcessRunner:
    """A pool of worker processes (pebble) for sync scorers, shared by every entry that uses one.
    Workers are forked: a fork server or spawn would re-run the parent's ``__main__`` in every
    worker, and a service script's ``__main__`` starts a whole stage. A forked worker only runs
    ``_call_in_worker``; it never touches the parent's event loop or Kafka connections
    (``_worker_init``). A call past its timeout ends its own worker, and only that record fails.

    A worker that dies under a record (a crash in a C extension, the OOM killer, a signal) is
    replaced (pebble starts a fresh one; a pool that broke altogether is built anew) and the
    record is tried again on a fresh worker, up to ``worker_retries`` times, each death counted
    in ``streamrl_reward_worker_deaths_total``; only a record that kills every worker it is
    given fails, as ``worker_died``."""

    #: Fresh workers a record is given after the one running it died.
    WORKER_RETRIES = 2

    def __init__(self, workers: int = 0, memory_mb: int = 0, worker_retries: int = WORKER_RETRIES):
        self.workers = workers or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.worker_retries = worker_retries
        self._pool = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._pool is not None and not self._pool.active:  # broke: a worker died idle
                self._pool.stop()
                self._pool.join(timeout=5)
                self._pool = None
            if self._pool is None:
                import pebble

                self._pool = pebble.ProcessPool(max_workers=self.workers, initializer=_worker_init,
                                                initargs=(self.memory_mb,),
                                                context=multiprocessing.get_context("fork"))

    async def call(self, ref: str, kwargs: dict[str, Any], timeout_s: float,
                   tokenizer: str = "", scorer: str = "") -> Any:
        import pebble

        from streamrl import metrics

        died = ""
        for _ in range(self.worker_retries + 1):
            self.start()
            try:
                future = self._pool.schedule(_call_in_worker, args=(ref, kwargs, tokenizer),
                                             timeout=timeout_s if timeout_s > 0 else None)
                return await asyncio.wrap_future(future)
            except concurrent.futures.TimeoutError:
                raise Failure("timeout", f"{ref} ran over {timeout_s} s in its worker process "
                                            "(the worker was killed)") from None
            except MemoryError:
                raise Failure("memory", f"{ref} passed the worker's memory cap of {self.memory_mb} MB "
                                        "(above what it inherits)") from None
            except (pebble.ProcessExpired, concurrent.futures.process.BrokenProcessPool) as exc:
                died = str(exc) + (f", exit code {exc.exitcode}" if isinstance(exc, pebble.ProcessExpired) else "")
            except RuntimeError as exc:  # the pool broke between start() and schedule()
                if self._pool is None or self._pool.active:
                    raise
                died = str(exc)
            metrics.REWARD_WORKER_DEATHS.labels(scorer or ref).inc()
            log.warning("%s: its worker process died (%s)", ref, died)
        raise Failure("worker_died", f"{ref}: its worker process died on each of "
                                     f"{self.worker_retries + 1} workers ({died})")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=5)
            self._pool = None


async def in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a thread of its own, marked daemon. A call abandoned at its timeout keeps
    running (a thread cannot be killed), but it must not hold the member at exit: asyncio's
    default executor joins its threads on shutdown, so one stuck call would stop a member from
    ever leaving its group."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # cancelled: the caller timed out and went on
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: nobody waits for this any more
            pass

    threading.Thread(target=run, name="streamrl-scorer", daemon=True).start()
    return await future


class FunctionScorer:
    """A verl-signature function as a table entry's async scorer: by reference (``ref``), or a
    callable already built (``fn``: a reward class's bound ``compute_score``, which cannot be
    re-loaded in a worker process)."""

    def __init__(self, ref: str, *, name: str, kwargs: dict[str, Any] | None = None,
                 executor: str = "inline", timeout_s: float = 30.0,
                 available: dict[str, Any] | None = None, runner: ProcessRunner | None = None,
                 version: str = "", tokenizer_name: str = "", threads: asyncio.Semaphore | None = None,
                 fn: Callable[..., Any] | None = None):
        self.ref, self.name = ref, name
        where = f"config field 'reward.scorers.{name}"
        try:
            self.fn = fn or load_function(ref)
        except ConfigError as exc:
            raise ConfigError(f"{where}.path': {exc}") from None
        if fn is not None and executor == "process":
            raise ConfigError(f"{where}.executor': a reward class's compute_score runs inline or in "
                              f"threads (its object lives in this process), not in a process")
        self.kwargs = dict(kwargs or {})
        self.is_async = inspect.iscoroutinefunction(self.fn)
        if self.is_async and executor not in ("auto", "inline"):
            raise ConfigError(f"{where}.executor': {ref} is async; it runs on the event loop, "
                              f"not in a {executor}")
        self.executor = "inline" if executor == "auto" and self.is_async else executor
        if self.executor == "auto":  # a sync function: most often a blocking remote call
            self.executor = "thread"
        self.threads = threads or asyncio.Semaphore(64)
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
            return await self.runner.call(self.ref, call, self.timeout_s, tokenizer, self.name)
        if self.executor == "thread":
            async with self.threads:
                return await self._bounded(in_daemon_thread(functools.partial(self.fn, **call)), timeout)
        return self.fn(**call)

    async def _bounded(self, awaitable: Any, timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            raise Failure("timeout", f"{self.ref} ran over {timeout} s") from None


class BatchFunctionScorer:
    """verl's batch reward function (``BatchRewardManager``):
    ``compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list``,
    called in a thread on micro-batches of the records in flight (``batch_size`` at most, or what
    came within ``batch_wait_ms``); each record gets its own entry of the list."""

    def __init__(self, ref: str, *, name: str, kwargs: dict[str, Any] | None = None,
                 timeout_s: float = 120.0, batch_size: int = 32, batch_wait_ms: float = 20.0,
                 version: str = ""):
        self.ref, self.name, self.timeout_s = ref, name, timeout_s
        try:
            self.fn = load_function(ref)
        except ConfigError as exc:
            raise ConfigError(f"config field 'reward.scorers.{name}.path': {exc}") from None
        self.kwargs = dict(kwargs or {})
        self.batcher = MicroBatcher(self._run, batch_size, batch_wait_ms / 1000.0)
        self.version = version or module_version(self.fn)

    async def start(self) -> None:
        """The batcher starts with the first record."""

    async def close(self) -> None:
        await self.batcher.close()

    def set_share(self, fraction: float) -> None:
        """No group-wide limits."""

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict[str, Any] | None = None, **offered: Any) -> Any:
        return await self.batcher.submit((data_source, solution_str, ground_truth, extra_info))

    async def _run(self, items: list[tuple[Any, ...]]) -> list[Any]:
        sources, solutions, truths, infos = (list(col) for col in zip(*items))
        call = functools.partial(self.fn, data_sources=sources, solution_strs=solutions,
                                 ground_truths=truths, extra_infos=infos, **self.kwargs)
        try:
            return list(await asyncio.wait_for(in_daemon_thread(call), self.timeout_s))
        except asyncio.TimeoutError:
            raise Failure("timeout", f"{self.ref} ran over {self.timeout_s} s on a batch of {len(items)}") from None
