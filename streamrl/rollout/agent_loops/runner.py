"""verl's agent loops in a rollout worker: which loop serves a prompt, built as verl builds it,
run per sample, and turned into trajectories.

- ``rollout.agent.agent_loop_config_path``: verl's agent-loop config, a YAML list of
  ``{name, _target_, ...}`` (the other keys go to the constructor, as Hydra's ``instantiate``
  passes them). Every class is imported at start: a bad entry fails the worker, naming it.
- A prompt's ``agent_name`` (verl's data column; the feed carries it in ``extra_info``) picks the
  loop; without one, ``rollout.agent.default_agent_loop``.
- A name resolves to the config's entry, else a class registered with ``register`` (streamrl's,
  or verl's when verl imports). verl's two built-in names, ``single_turn_agent`` and
  ``tool_agent``, are streamrl's own turn loop (``streamrl.rollout.episode``: one turn, or tools
  and interactions from ``rollout.multi_turn``) unless the config names a class for them. A
  name that resolves to nothing sends the prompt to dead letters, naming the known ones.

Each of the group's ``n`` samples gets its own loop object and its own server manager
(``EpisodeServer``), run concurrently. The trajectory's tokens are the loop's ``prompt_ids`` and
``response_ids`` with its ``response_mask``; every token under mask 1 is matched to a token the
policy sampled (its log-prob and weights version come from that record), the others are given
tokens (mask 0). ``response`` is the response decoded without special tokens (verl's reward
input). The loop's ``reward_score``, when set, travels as the record's ``reward_score``: the
reward group publishes it instead of scoring (verl's reward loop skips a sample that has one).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import numpy as np
import yaml

from streamrl.config import ConfigError
from streamrl.errors import Failure, Unavailable
from streamrl.records import Prompt, Trajectory
from streamrl.rollout.agent_loops.base import DictConfigWrap, ToolListWrap, _agent_loop_registry
from streamrl.rollout.agent_loops.server import EpisodeServer
from streamrl.rollout.backends import Backend, BackendError, BackendUnavailable, SamplingParams
from streamrl.rollout.trajectory import jsonable, turn_score

if TYPE_CHECKING:
    from streamrl.rollout.config import RolloutConfig

log = logging.getLogger(__name__)

#: verl's built-in agent loops, which streamrl's own turn loop runs (see the module doc)
BUILTIN = ("single_turn_agent", "tool_agent")
FIELD = "rollout.agent.agent_loop_config_path"


def verl_registry() -> dict[str, Any]:
    """verl's agent-loop registry when verl's agent loop imports (its built-ins registered), else
    empty: verl installed without Ray, Hydra or tensordict cannot run its loops."""
    from streamrl.rollout.interactions.registry import verl_installed

    if not verl_installed():
        return {}
    try:
        importlib.import_module("verl.experimental.agent_loop")
        return importlib.import_module("verl.experimental.agent_loop.agent_loop")._agent_loop_registry
    except Exception as exc:  # noqa: BLE001 - a verl that cannot load its agent loop: ours only
        log.warning("verl's agent loop does not import (%s: %s): streamrl's registry only", type(exc).__name__, exc)
        return {}


def load_target(target: Any, where: str, config_dir: Path | None = None) -> type:
    """The class a ``_target_`` names (``module.Class``, ``module:Class`` or ``file.py:Class``)."""
    from streamrl.rollout.interactions.registry import load_class

    if not isinstance(target, str) or not target:
        raise ConfigError(f"config field {where!r}: _target_ must name a class (module.Class)")
    cls, _ = load_class(target, where, config_dir)
    if not callable(getattr(cls, "run", None)) or not inspect.iscoroutinefunction(cls.run):
        raise ConfigError(f"config field {where!r}: {target} has no 'async def run(self, sampling_params, **kwargs)'")
    return cls


def load_agent_loop_config(path: str) -> dict[str, tuple[type, dict[str, Any]]]:
    """name -> (class, constructor keywords) for each entry of verl's agent-loop config."""
    from streamrl.rollout.interactions.registry import resolve_config_file

    file = resolve_config_file(path, FIELD)
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, OSError) as exc:
        raise ConfigError(f"config field {FIELD!r}: {file}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, list) or not data:
        raise ConfigError(f"config field {FIELD!r}: {file}: wants a list of {{name, _target_}} entries (verl's form)")
    out: dict[str, tuple[type, dict[str, Any]]] = {}
    for i, entry in enumerate(data):
        where = f"{FIELD}: {file}: [{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ConfigError(f"config field {where!r}: an entry is a mapping with a 'name' and a '_target_'")
        if entry["name"] in out:
            raise ConfigError(f"config field {where!r}: duplicate agent loop name {entry['name']!r}")
        kwargs = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
        out[entry["name"]] = (load_target(entry.get("_target_"), f"{where}._target_", file.parent), kwargs)
    return out


def trainer_config(cfg: "RolloutConfig") -> Any:
    """The part of verl's trainer config an agent loop reads (``self.config``,
    ``self.rollout_config``), filled from the rollout config."""
    from omegaconf import OmegaConf

    mt = cfg.multi_turn
    rollout = {
        "name": cfg.backend, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": -1,
        "prompt_length": cfg.agent.prompt_length or 1 << 30,
        "response_length": cfg.agent.response_length or cfg.max_new_tokens,
        "calculate_log_probs": True, "full_determinism": False,
        "multi_turn": {"enable": mt.enabled, "max_assistant_turns": mt.max_assistant_turns,
                       "max_user_turns": mt.max_user_turns, "max_parallel_calls": mt.max_parallel_calls,
                       "max_tool_response_length": mt.max_tool_response_length,
                       "tool_response_truncate_side": mt.tool_response_truncate_side, "format": mt.format,
                       "tool_config_path": mt.tool_config_path or None,
                       "interaction_config_path": mt.interaction_config_path or None},
        "agent": {"default_agent_loop": cfg.agent.default_agent_loop,
                  "agent_loop_config_path": cfg.agent.agent_loop_config_path or None},
    }
    return OmegaConf.create({"actor_rollout_ref": {"rollout": rollout, "model": {"path": cfg.policy}},
                             "data": {"apply_chat_template_kwargs": {}}})


class AgentLoops:
    """The agent loops a rollout worker can run, resolved by name (see the module doc)."""

    def __init__(self, cfg: "RolloutConfig", tools: list[Any] | None = None):
        self.cfg = cfg
        self.default = cfg.agent.default_agent_loop or BUILTIN[0]
        self.configured = load_agent_loop_config(cfg.agent.agent_loop_config_path) \
            if cfg.agent.agent_loop_config_path else {}
        self.trainer_config = trainer_config(cfg)
        self.tools = list(tools or [])
        self._classes: dict[str, tuple[type, dict[str, Any]]] = dict(self.configured)
        self._tokenizer: Any = None
        if self.default not in BUILTIN:  # the default must resolve at start
            self.resolve(self.default, at_start=True)

    def name_for(self, prompt: Prompt) -> str:
        name = prompt.extra_info.get("agent_name")
        if name is None or name == "":
            return self.default
        if not isinstance(name, str):
            raise Failure("unknown_agent_loop", f"agent_name is a {type(name).__name__}, not a string")
        return name

    def runs(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` goes to an agent loop (else to streamrl's own turn loop)."""
        name = self.name_for(prompt)
        return name not in BUILTIN or name in self.configured

    def resolve(self, name: str, at_start: bool = False) -> tuple[type, dict[str, Any]]:
        if name in self._classes:
            return self._classes[name]
        entry = _agent_loop_registry.get(name) or verl_registry().get(name)
        if entry is None:
            known = sorted({*self.configured, *_agent_loop_registry, *verl_registry(), *BUILTIN})
            msg = f"agent loop {name!r} is not registered (known: {', '.join(known)})"
            if at_start:
                raise ConfigError(f"config field 'rollout.agent.default_agent_loop': {msg}")
            raise Failure("unknown_agent_loop", msg)
        entry = dict(entry)
        target = entry.pop("_target_", None)
        entry.pop("name", None)
        try:
            cls = load_target(target, f"agent loop {name!r}")
        except ConfigError as exc:
            if at_start:
                raise
            raise Failure("unknown_agent_loop", str(exc)) from None
        self._classes[name] = (cls, entry)
        return self._classes[name]

    def build(self, name: str, server: EpisodeServer, tokenizer: Any) -> Any:
        """One loop object, constructed with verl's keywords (and its config entry's own)."""
        cls, extra = self.resolve(name)
        try:
            return cls(trainer_config=DictConfigWrap(self.trainer_config), server_manager=server, tokenizer=tokenizer,
                       processor=None, dataset_cls=None, data_config=DictConfigWrap(self.trainer_config.data),
                       hf_model_type=None, tools=ToolListWrap(self.tools), **extra)
        except Exception as exc:  # noqa: BLE001 - a user's constructor: any failure, named
            raise Failure("agent_loop_error", f"agent loop {name!r}: {cls.__name__}(...) failed: "
                                              f"{type(exc).__name__}: {exc}") from None

    def tokenizer(self) -> Any:
        """The policy's tokenizer (``rollout.policy``) for a backend without one (a server
        fleet: the loops build token prompts, the servers sample from them)."""
        if self._tokenizer is None:
            from streamrl.policy import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.cfg.policy)
            except Exception as exc:  # noqa: BLE001 - named: agent loops cannot run without one
                raise Failure("agent_loop_error", f"agent loops need the policy's tokenizer (rollout.policy "
                                                  f"{self.cfg.policy!r}): {type(exc).__name__}: {exc}") from None
        return self._tokenizer

    def sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        """verl's sampling params for a loop's ``run`` (its ``generate_sequences``)."""
        return {"temperature": params.temperature, "top_p": params.top_p, "top_k": -1, "repetition_penalty": 1.0,
                "logprobs": True}

    async def run_group(self, prompt: Prompt, n: int, backend: Backend, params: SamplingParams,
                        before_turn: Callable[[], Awaitable[None]] | None = None) -> list[Trajectory]:
        """``n`` episodes of ``prompt``'s agent loop, concurrently, as trajectories."""
        tokenizer = backend.tokenizer or self.tokenizer()
        name = self.name_for(prompt)
        started_at = time.time()
        servers = [EpisodeServer(backend, params, before_turn) for _ in range(n)]
        outputs = await asyncio.gather(*(self._run_one(name, prompt, i, s, tokenizer, params)
                                         for i, s in enumerate(servers)))
        return [self._trajectory(prompt, n, i, name, out, s, tokenizer, started_at)
                for i, (out, s) in enumerate(zip(outputs, servers))]

    async def _run_one(self, name: str, prompt: Prompt, index: int, server: EpisodeServer, tokenizer: Any,
                       params: SamplingParams) -> Any:
        loop = self.build(name, server, tokenizer)
        try:
            return await loop.run(self.sampling_params(params), **sample_fields(prompt, name))
        except (Failure, BackendError, BackendUnavailable, asyncio.CancelledError):
            raise
        except Unavailable as exc:
            raise BackendUnavailable(f"agent loop {name!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a user's loop: any error fails this prompt, named
            raise Failure("agent_loop_error", f"agent loop {name!r}: {type(exc).__name__}: {exc}") from None

    def _trajectory(self, prompt: Prompt, n: int, index: int, name: str, out: Any, server: EpisodeServer,
                    tokenizer: Any, started_at: float) -> Trajectory:
        for attr in ("prompt_ids", "response_ids", "response_mask"):
            if not isinstance(getattr(out, attr, None), (list, tuple)):
                raise Failure("agent_loop_error", f"agent loop {name!r} returned no {attr} list "
                                                  f"(an AgentLoopOutput, got {type(out).__name__})")
        if not any(c.token_ids for c in server.calls):
            raise Failure("agent_loop_error", f"agent loop {name!r} sampled nothing (no generate call returned "
                                              "tokens): no trajectory to train on")
        response_ids = [int(t) for t in out.response_ids]
        mask = [1 if m else 0 for m in out.response_mask]
        logprobs, runs = server.stamp(response_ids, mask)
        oldest = min(v for c in server.calls for v in c.versions)
        reward = getattr(out, "reward_score", None)
        if reward is not None and turn_score(reward) is None:
            raise Failure("agent_loop_error", f"agent loop {name!r}: reward_score {reward!r} is not a finite number")
        extra = dict(prompt.extra_info)
        extra.update(sample_index=index, agent_name=name, num_turns=int(getattr(out, "num_turns", 0) or 0),
                     generate_calls=len(server.calls))
        fields = jsonable(dict(getattr(out, "extra_fields", None) or {}))
        if fields:
            extra["agent_extra_fields"] = fields
        return Trajectory(
            id=f"{prompt.group_id}-{index}", group_id=prompt.group_id, group_size=n,
            policy_version=oldest,
            token_versions=runs.as_field(), data_source=prompt.data_source, prompt=prompt.prompt,
            response=tokenizer.decode(response_ids, skip_special_tokens=True), ground_truth=prompt.ground_truth,
            extra_info=extra, prompt_ids=np.asarray([int(t) for t in out.prompt_ids], dtype=np.int32),
            response_ids=np.asarray(response_ids, dtype=np.int32), response_logprobs=logprobs,
            response_mask=np.asarray(mask, dtype=np.uint8),
            reward_score=None if reward is None else float(reward),
            timings={"generation_started_at": started_at, "generation_s": server.generation_s,
                     "agent_loop_s": time.time() - started_at})


def sample_fields(prompt: Prompt, agent_name: str) -> dict[str, Any]:
    """The sample's fields as verl's dataset hands them to ``run``: the chat messages
    (``raw_prompt``), ``data_source``, ``reward_model``, ``extra_info`` and the per-sample
    ``tools_kwargs`` / ``interaction_kwargs`` / ``index`` it carries, and ``agent_name``."""
    extra = dict(prompt.extra_info)
    messages = ([{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str)
                else [dict(m) for m in prompt.prompt])
    return {"raw_prompt": messages, "data_source": prompt.data_source,
            "reward_model": {"style": "rule", "ground_truth": prompt.ground_truth}, "extra_info": extra,
            "tools_kwargs": extra.get("tools_kwargs") or {}, "interaction_kwargs": extra.get("interaction_kwargs") or {},
            "index": extra.get("index", 0), "agent_name": agent_name}
