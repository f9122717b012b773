"""The reward stage's scorer table: ``data_source`` -> the entry that scores it.

``build_table`` turns ``reward.scorers`` into entries (built-in rules, user functions, LLM judges,
reward models, hybrids) and checks everything it can when the stage starts (references resolve,
signatures fit, sections are valid), so a bad config fails then, naming the field, and not on the
first record. Judge, model and math modules load only when an entry needs them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from streamrl.config import load_section
from streamrl.errors import ConfigError
from streamrl.loading import load_object
from streamrl.reward.config import EXECUTORS, SCORER_TYPES, OverlongBufferConfig, RewardConfig, ScorerSpec, routes
from streamrl.scorers.loader import BatchFunctionScorer, FunctionScorer, ProcessRunner
from streamrl.scorers.rules import RULES, VERL_COMPAT_ENTRIES, serves, verl_compat
from streamrl.servers.processes import ServerProcesses

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One row of the table: the scorer (an async callable with verl's signature and
    ``start`` / ``close`` / ``set_share``) and what the stage needs to know about it."""

    name: str
    scorer: Any
    version: str
    data_sources: list[str]
    fallbacks: dict[str, float] = field(default_factory=dict)
    overlong: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    post_process: Any = None  # a reward class's post_process_scores: this entry's group hook
    default_route: bool = False  # a built-in rule on its usual data sources: yields them (reward.config.routes)

    @property
    def label(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version}


class ScorerTable:
    """``data_source`` -> ``Entry``. Built by ``build_table``; ``start`` before use."""

    def __init__(self, entries: dict[str, Entry], runner: Any, reward_router: str = ""):
        self.entries, self.runner, self.reward_router = entries, runner, reward_router
        self.servers: Any = None  # reward.servers (streamrl.servers.processes.ServerProcesses), if any
        self._router: Any = None  # reward_router over a reward.servers entry (a generative reward model's)
        self._session: Any = None
        self.routes: dict[str, Entry] = {}  # data source (or "prefix*") -> entry
        self.yielded: dict[str, str] = {}  # a built-in's default route -> the entry that took it
        own = [e for e in entries.values() if not e.default_route]
        for entry in own:  # the user's routes first: each data source at most once
            for ds in entry.data_sources:
                if ds in self.routes:
                    raise ConfigError(
                        f"config field 'reward.scorers.{entry.name}.data_sources': {ds!r} is claimed by "
                        f"both {self.routes[ds].name!r} and {entry.name!r}; a data source goes to one entry "
                        f"(take it out of one, e.g. reward.scorers.{self.routes[ds].name}.data_sources=[...])")
                self.routes[ds] = entry
        for entry in entries.values():  # then the built-ins' usual data sources nobody took
            if not entry.default_route:
                continue
            for ds in entry.data_sources:
                # an exact route of the user's takes that data source; a "prefix*" of theirs
                # (custom_reward_function's "*") every default route under it
                taker = next((e for p, e in self.routes.items()
                              if p == ds or (p.endswith("*") and serves(p, ds.rstrip("*")))), None)
                if taker is not None:
                    self.yielded[ds] = taker.name
                elif ds in self.routes:  # two built-ins (verl_compat moves routes between them)
                    raise ConfigError(f"config field 'reward.scorers.{entry.name}.data_sources': {ds!r} "
                                      f"is claimed by both {self.routes[ds].name!r} and {entry.name!r}")
                else:
                    self.routes[ds] = entry
        # prefixes, longest first: "aime2024*" before "aime*"
        self._prefixes = sorted((ds for ds in self.routes if ds.endswith("*")), key=len, reverse=True)

    def lookup(self, data_source: str) -> Entry | None:
        entry = self.routes.get(data_source)
        if entry is None:
            prefix = next((p for p in self._prefixes if serves(p, data_source)), None)
            entry = self.routes.get(prefix) if prefix else None
        return entry

    async def start(self) -> None:
        if self.servers is not None:  # up and healthy before the scorers that call them start
            await self.servers.start()
        managers = [e for e in self.entries.values() if getattr(e.scorer, "wants_record", False)]
        for entry in self.entries.values():
            if entry not in managers:
                await entry.scorer.start()
        address = await self._router_address()
        if address:
            from streamrl.scorers.loader import FunctionScorer
            for entry in self.entries.values():
                if isinstance(entry.scorer, FunctionScorer):
                    entry.scorer.available["reward_router_address"] = address
        for entry in managers:  # a reward manager is built with the router's address (verl's signature)
            entry.scorer.reward_router_address = address or None
            await entry.scorer.start()

    async def _router_address(self) -> str:
        if not self.reward_router:
            return ""
        if self.servers is not None and self.reward_router in self.servers.specs:
            return await self._servers_router(self.reward_router)
        entry = self.entries.get(self.reward_router)
        if entry is None:
            return self.reward_router  # a literal HOST:PORT
        return await entry.scorer.router_address()

    async def _servers_router(self, name: str) -> str:
        """A router over the replicas of ``reward.servers`` entry ``name`` (a generative reward
        model's), served as a local proxy: verl's ``reward_router_address``."""
        import aiohttp

        from streamrl.servers.router import Router

        self._session = aiohttp.ClientSession()
        self._router = Router(self.servers.urls(name), name=name, health_path="/health")
        await self._router.start(self._session)
        return await self._router.start_proxy()

    async def close(self) -> None:
        if self._router is not None:
            await self._router.close()
            await self._session.close()
            self._router = None
        for entry in self.entries.values():
            try:
                await entry.scorer.close()
            except Exception:  # noqa: BLE001 - close the others regardless
                log.exception("closing scorer %s failed", entry.name)
        if self.servers is not None:
            await self.servers.close()
        if self.runner is not None:
            self.runner.close()

    def set_share(self, fraction: float) -> None:
        for entry in self.entries.values():
            entry.scorer.set_share(fraction)


def build_table(cfg: RewardConfig) -> ScorerTable:
    """The table for a reward config. Raises ``ConfigError`` naming the field."""
    runner = ProcessRunner(cfg.process_workers, cfg.process_memory_mb)
    threads = asyncio.Semaphore(cfg.thread_concurrency)  # shared by every thread-executor entry
    router = cfg.reward_router
    servers = {s.name for s in cfg.servers}
    if router and router not in cfg.scorers and router not in servers and ":" not in router:
        raise ConfigError(f"config field 'reward.reward_router': {router!r} is neither a scorer "
                          f"entry, a reward.servers entry nor HOST:PORT")
    if router in cfg.scorers and router not in servers and cfg.scorers[router].type != "judge":
        raise ConfigError(f"config field 'reward.reward_router': entry {router!r} is a "
                          f"{cfg.scorers[router].type} scorer; only a judge has a router")
    available: dict[str, Any] = {
        # the real address is filled in at start; the signature check only needs to know
        # whether there will be one
        "reward_router_address": "pending" if router else None,
        "reward_model_tokenizer": None,  # loaded below when configured
        "prompt": "",  # every record offers its prompt
    }
    if cfg.reward_model_tokenizer:
        from streamrl.scorers.loader import load_tokenizer

        try:
            available["reward_model_tokenizer"] = load_tokenizer(cfg.reward_model_tokenizer)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"config field 'reward.reward_model_tokenizer': cannot load "
                              f"{cfg.reward_model_tokenizer!r}: {exc}") from None
    entries: dict[str, Entry] = {}
    hybrids = []
    scorers, defaults = routes(cfg.scorers)
    if cfg.verl_compat:
        scorers = verl_compat(scorers, ScorerSpec)
        defaults |= {added for base, added in VERL_COMPAT_ENTRIES.items() if base in defaults and added in scorers}
    for name, spec in scorers.items():
        where = f"config field 'reward.scorers.{name}"
        if spec.type not in SCORER_TYPES:
            raise ConfigError(f"{where}.type': {spec.type!r} is not one of {SCORER_TYPES}")
        if spec.executor not in EXECUTORS:
            raise ConfigError(f"{where}.executor': {spec.executor!r} is not one of {EXECUTORS}")
        data_sources = list(spec.data_sources or [])
        ob = spec.overlong_buffer
        if ob.enable and not 0 < ob.len < ob.max_resp_len:
            raise ConfigError(f"{where}.overlong_buffer': needs 0 < len < max_resp_len "
                              f"(got len {ob.len}, max_resp_len {ob.max_resp_len})")
        if spec.type == "hybrid":
            hybrids.append((name, spec, data_sources))
            continue
        scorer = _build_scorer(name, spec, available, runner, cfg.reward_model_tokenizer, threads)
        entries[name] = Entry(name, scorer, spec.version or str(getattr(scorer, "version", "0")),
                              data_sources, dict(spec.fallbacks), spec.overlong_buffer,
                              _post_process(scorer), default_route=name in defaults)
    for name, spec, data_sources in hybrids:
        from streamrl.scorers.hybrid import HybridScorer

        parts = {}
        for part, weight in spec.parts.items():
            if part not in entries:
                raise ConfigError(f"config field 'reward.scorers.{name}.parts': {part!r} is not a "
                                  f"non-hybrid entry of reward.scorers")
            parts[part] = (entries[part].scorer, float(weight))
        try:
            scorer = HybridScorer(name, parts)
        except ValueError as exc:
            raise ConfigError(f"config field 'reward.scorers.{name}.parts': {exc}") from None
        entries[name] = Entry(name, scorer, spec.version or scorer.version, data_sources,
                              dict(spec.fallbacks))
    table = ScorerTable(entries, runner, router)

    table.servers = ServerProcesses.for_table(cfg.servers, entries)  # attaches model.server entries
    return table


def _build_scorer(name: str, spec: ScorerSpec, available: dict[str, Any], runner: Any,
                  tokenizer_name: str, threads: asyncio.Semaphore) -> Any:
    where = f"config field 'reward.scorers.{name}"
    if spec.type == "class":
        return _build_class(name, spec, available, threads)
    if spec.type == "manager":
        return _build_manager(name, spec, available)
    if spec.type == "function" and spec.batch:
        if spec.batch_size < 1:
            raise ConfigError(f"{where}.batch_size': must be at least 1")
        return BatchFunctionScorer(spec.path, name=name, kwargs=dict(spec.kwargs), timeout_s=spec.timeout_s,
                                   batch_size=spec.batch_size, batch_wait_ms=spec.batch_wait_ms,
                                   version=spec.version)
    if spec.type in ("rule", "function"):
        if spec.type == "rule":
            rule = RULES.get(spec.rule or name)
            if rule is None:
                raise ConfigError(f"{where}.rule': {spec.rule or name!r} is not a built-in rule "
                                  f"({sorted(RULES)}); use type: function for your own")
            ref, executor = rule.ref, (rule.executor if spec.executor == "auto" else spec.executor)
        else:
            if not spec.path:
                raise ConfigError(f"{where}.path': a function scorer needs 'file.py:name' or 'module:name'")
            ref, executor = spec.path, spec.executor
        return FunctionScorer(ref, name=name, kwargs=dict(spec.kwargs), executor=executor,
                              timeout_s=spec.timeout_s, available=available, runner=runner,
                              version=spec.version, tokenizer_name=tokenizer_name, threads=threads)
    section = f"reward.scorers.{name}.{spec.type}"
    try:
        if spec.type == "judge":
            from streamrl.scorers.judge import JudgeConfig, JudgeScorer

            return JudgeScorer(load_section(JudgeConfig, spec.judge, section), name=name)
        from streamrl.scorers.model import ModelScorer, ModelScorerConfig

        return ModelScorer(load_section(ModelScorerConfig, spec.model, section), name=name)
    except ConfigError as exc:  # their checks name the field after the entry: give the full path
        raise ConfigError(str(exc).replace(f"'{name}.", f"'{section}.", 1)) from None


def _build_class(name: str, spec: ScorerSpec, available: dict[str, Any], threads: asyncio.Semaphore) -> Any:
    """A reward class (``path: file.py:ClassName``) built with ``kwargs``; its ``compute_score``
    is the entry's scorer (``_post_process`` finds the object's ``post_process_scores``)."""
    where = f"config field 'reward.scorers.{name}"
    cls = load_object(spec.path, f"reward.scorers.{name}.path", "class")
    try:
        instance = cls(**spec.kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}.kwargs': {spec.path}({', '.join(spec.kwargs)}): {exc}") from None
    if not callable(getattr(instance, "compute_score", None)):
        raise ConfigError(f"{where}.path': {spec.path} has no compute_score method")
    scorer = FunctionScorer(f"{spec.path}.compute_score", name=name, executor=spec.executor,
                            timeout_s=spec.timeout_s, available=available, version=spec.version,
                            threads=threads, fn=instance.compute_score)
    return scorer


def _build_manager(name: str, spec: ScorerSpec, available: dict[str, Any]) -> Any:
    """A verl reward manager (``streamrl.reward.managers``): the custom reward function loaded
    first (its module may register the manager, as in verl), with its ``kwargs`` bound."""
    from streamrl.reward.managers import ManagerScorer, ManagerSpec, bind_reward_kwargs, resolve_manager_cls
    from streamrl.scorers.loader import load_function
    from streamrl.scorers.rules import default_compute_score

    section = f"reward.scorers.{name}.manager"
    mspec = load_section(ManagerSpec, spec.manager, section)
    compute = default_compute_score
    if spec.path:
        try:
            compute = bind_reward_kwargs(load_function(spec.path), dict(spec.kwargs))
        except ConfigError as exc:
            raise ConfigError(f"config field 'reward.scorers.{name}.path': {exc}") from None
    cls = resolve_manager_cls(mspec, section)
    return ManagerScorer(cls, mspec, name=name, compute_score=compute,
                         reward_model_tokenizer=available.get("reward_model_tokenizer"), version=spec.version)


def _post_process(scorer: Any) -> Any:
    """A reward class's ``post_process_scores`` (its group hook), found through the bound
    ``compute_score`` the entry scores with; None for everything else."""
    owner = getattr(getattr(scorer, "fn", None), "__self__", None)
    return getattr(owner, "post_process_scores", None) if owner is not None else None
