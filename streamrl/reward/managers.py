"""verl's reward managers run in the reward group: a manager class written against verl's
reward-loop interface (``RewardManagerBase``: built with ``config``, ``tokenizer``,
``compute_score``, ``reward_router_address``, ``reward_model_tokenizer``; ``async
run_single(data) -> {"reward_score", "reward_extra_info"}``) scores records here unchanged.

Where the class comes from, as verl resolves it (``verl.trainer.ppo.reward.resolve_reward_manager_cls``):

- ``source: register``: a name registered with ``register`` (this module's, for code that runs
  without verl) or with verl's own ``verl.experimental.reward_loop.reward_manager.register``
  (a recipe's module that imports verl: its registry is read where the module registered in it;
  streamrl never imports verl). The module registers when it is imported: as in verl, that is
  the custom reward function's module (``custom_reward_function.path``), or ``module.path``.
- ``source: importlib``: the class named ``reward_manager.name`` in the file or module
  ``module.path`` (verl 0.9.1 loads that name; ``module.name`` is tried after it).

Each member of the reward group builds one instance when it starts (verl: one per reward-loop
worker). A record is handed to ``run_single`` as verl hands it, one record at a time, in a
``RecordData``: verl's ``DataProto`` fields its managers read (``batch["prompts"]``,
``["responses"]``, ``["attention_mask"]``, ``["input_ids"]``, ``["position_ids"]``,
``["response_mask"]``; ``non_tensor_batch["data_source"]``, ``["reward_model"]["ground_truth"]``,
``["extra_info"]``, ``["raw_prompt"]``, ``["uid"]``, ``["__num_turns__"]``), with the record's
token ids, or the policy tokenizer's ids of its text where a text-only producer left them out.
The manager's ``reward_score`` is the reward; its ``reward_extra_info`` goes to the record's
``reward_info`` (and its numbers to ``streamrl_reward_info``), as verl logs it.

``config`` is verl's config as the manager reads it (an OmegaConf ``DictConfig``:
``reward.reward_kwargs``, ``reward.num_workers``, ``reward.reward_manager``,
``reward.custom_reward_function``, ``reward.reward_model``, ``trainer.experiment_name``);
``compute_score`` is the custom reward function with its ``reward_kwargs`` bound (verl's
precedence: they win over the call's), else streamrl's ``default_compute_score``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from streamrl.errors import ConfigError
from streamrl.loading import load_object

__all__ = ["register", "get_reward_manager_cls", "RewardManagerBase", "RecordData", "RecordItem", "ManagerSpec",
           "ManagerScorer", "REGISTRY"]

#: streamrl's registry: name -> class (verl's own is read too, see ``get_reward_manager_cls``)
REGISTRY: dict[str, type] = {}
_VERL_REGISTRY = "verl.experimental.reward_loop.reward_manager.registry"


def register(name: str) -> Callable[[type], type]:
    """Register a reward manager class under ``name`` (verl's ``register``, for code that runs
    without verl installed)."""
    def decorator(cls: type) -> type:
        known = REGISTRY.get(name)
        # the same class again, from its module loaded once more (by file path, under another name): replaced
        if known is not None and known is not cls and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"reward manager {name} has already been registered: {REGISTRY[name]} vs {cls}")
        REGISTRY[name] = cls
        return cls
    return decorator


def get_reward_manager_cls(name: str) -> type | None:
    """The class registered as ``name``: streamrl's registry, then verl's where a module imported
    it (verl's own managers are built in here: ``reward.config.REWARD_MANAGERS``)."""
    if name in REGISTRY:
        return REGISTRY[name]
    verl = sys.modules.get(_VERL_REGISTRY)
    table = getattr(verl, "REWARD_MANAGER", None) if verl is not None else None
    return table.get(name) if isinstance(table, dict) else None


def registered_names() -> list[str]:
    verl = sys.modules.get(_VERL_REGISTRY)
    theirs = getattr(verl, "REWARD_MANAGER", {}) if verl is not None else {}
    return sorted(set(REGISTRY) | set(theirs))


class RewardManagerBase:
    """verl's reward-loop manager interface, for managers written without verl installed:
    ``config``, ``tokenizer``, ``compute_score`` and ``loop`` as verl's base sets them;
    ``init_class`` once per class; ``run_single`` scores one record."""

    _class_initialized = False

    def __init__(self, config: Any, tokenizer: Any, compute_score: Callable[..., Any] | None):
        self.config, self.tokenizer, self.compute_score = config, tokenizer, compute_score
        self.loop = asyncio.get_event_loop()
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config: Any, tokenizer: Any) -> None:
        if cls._class_initialized:
            return
        cls._class_initialized = True

    async def run_single(self, data: "RecordData") -> dict:
        raise NotImplementedError


@dataclass
class RecordItem:
    """One record of a ``RecordData`` (verl's ``DataProtoItem``): 1-D tensors and plain values."""

    batch: dict[str, Any]
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordData:
    """The fields of verl's ``DataProto`` that reward managers read: ``batch`` (name -> tensor,
    first dimension the records), ``non_tensor_batch`` (name -> object array), ``meta_info``.
    ``data[i]`` is a ``RecordItem``, ``data[a:b]`` a ``RecordData``, ``len(data)`` the records."""

    batch: dict[str, Any]
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        for column in self.non_tensor_batch.values():
            return len(column)
        return 0

    def __getitem__(self, index: int | slice) -> "RecordItem | RecordData":
        if isinstance(index, slice):
            return RecordData({k: v[index] for k, v in self.batch.items()},
                              {k: v[index] for k, v in self.non_tensor_batch.items()}, dict(self.meta_info))
        if isinstance(index, (int, np.integer)):
            return RecordItem({k: v[index] for k, v in self.batch.items()},
                              {k: v[index] for k, v in self.non_tensor_batch.items()}, dict(self.meta_info))
        raise TypeError(f"RecordData indices are ints or slices, not {type(index).__name__}")

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _objects(*values: Any) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def record_data(traj: Any, tokenizer: Any) -> RecordData:
    """One record as verl hands it to ``run_single``: its token ids (the policy tokenizer's ids
    of its text where it carries none), the attention mask over prompt and response, and the
    non-tensor fields of verl's batch."""
    import torch

    from streamrl.scorers.judge import render_prompt

    prompt_ids = (list(traj.array("prompt_ids")) if traj.prompt_ids is not None
                  else tokenizer.encode(render_prompt(traj.prompt), add_special_tokens=False))
    response_ids = (list(traj.array("response_ids")) if traj.response_ids is not None
                    else tokenizer.encode(traj.response or "", add_special_tokens=False))
    p, r = len(prompt_ids), len(response_ids)
    ids = torch.tensor([[*prompt_ids, *response_ids]], dtype=torch.long)
    raw_prompt = traj.prompt if isinstance(traj.prompt, list) else [{"role": "user", "content": traj.prompt}]
    extra_info = dict(traj.extra_info or {})
    batch = {"prompts": ids[:, :p], "responses": ids[:, p:], "input_ids": ids,
             "attention_mask": torch.ones((1, p + r), dtype=torch.long),
             "position_ids": torch.arange(p + r, dtype=torch.long).unsqueeze(0),
             "response_mask": torch.ones((1, r), dtype=torch.long)}
    turns = sum(1 for t in traj.turns or () if isinstance(t, dict) and t.get("role") == "assistant") or 1
    non_tensor = {"data_source": _objects(traj.data_source),
                  "reward_model": _objects({"ground_truth": traj.ground_truth, "style": "rule"}),
                  "extra_info": _objects(extra_info), "raw_prompt": _objects(raw_prompt),
                  "uid": _objects(traj.group_id), "__num_turns__": _objects(turns)}
    return RecordData(batch, non_tensor)


def _plain(value: Any) -> Any:
    """A manager's extra-info value as JSON can carry it (numpy and torch scalars to numbers)."""
    if hasattr(value, "tolist"):  # numpy and torch, scalars (0-d) included
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class ManagerSpec:
    """A ``type: manager`` entry's ``manager:`` section (``reward.config.apply_verl_keys`` fills
    it from verl's ``reward.reward_manager`` keys)."""

    name: str = ""  # the registered name, or the class's name in module_path (importlib)
    source: str = "register"  # register | importlib (verl's reward_manager.source)
    module_path: str = ""  # importlib: a file or module holding the class; register: a module to import first
    class_name: str = ""  # importlib: verl's module.name, tried after name
    tokenizer: str = "tiny"  # the policy's tokenizer (``tiny`` or a directory): what run_single decodes with
    config: dict[str, Any] = field(default_factory=dict)  # verl's config as the manager reads it


def resolve_manager_cls(spec: ManagerSpec, where: str) -> type:
    """The manager class for ``spec`` (see the module's doc), or ``ConfigError`` naming ``where``."""
    if spec.source == "importlib":
        if not spec.module_path:
            raise ConfigError(f"config field '{where}.module_path': source importlib needs the module "
                              f"(verl's reward.reward_manager.module.path)")
        names = [n for n in (spec.name, spec.class_name) if n]
        last: ConfigError | None = None
        for name in names:
            try:
                cls = load_object(f"{spec.module_path}:{name}", f"{where}.module_path", "class")
                break
            except ConfigError as exc:
                last = exc
        else:
            raise last or ConfigError(f"config field '{where}.name': the class's name in {spec.module_path}")
    elif spec.source == "register":
        if spec.module_path:
            _import_module(spec.module_path, f"{where}.module_path")
        cls = get_reward_manager_cls(spec.name)
        if cls is None:
            raise ConfigError(f"config field '{where}.name': no reward manager {spec.name!r} is registered "
                              f"(registered: {registered_names()}; a module registers its own when imported: "
                              f"custom_reward_function.path, or reward_manager.source=importlib)")
    else:
        raise ConfigError(f"config field '{where}.source': {spec.source!r} is not register or importlib")
    if not inspect.isclass(cls) or not inspect.iscoroutinefunction(getattr(cls, "run_single", None)):
        raise ConfigError(f"config field '{where}.name': {cls!r} is no reward manager (verl's interface: a "
                          f"class with async run_single(data))")
    return cls


def _import_module(path: str, where: str) -> None:
    import importlib
    import importlib.util
    from pathlib import Path

    path = path.removeprefix("file://").removeprefix("pkg://")
    try:
        if path.endswith(".py"):
            name = f"streamrl_user_{Path(path).stem}_{abs(hash(str(Path(path).resolve())))}"
            if name in sys.modules:
                return
            loc = importlib.util.spec_from_file_location(name, path)
            if loc is None or loc.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(loc)
            sys.modules[name] = module
            loc.loader.exec_module(module)
        else:
            importlib.import_module(path.replace("/", "."))
    except (ImportError, OSError, SyntaxError) as exc:
        raise ConfigError(f"config field '{where}': {path}: {exc}") from None


class ManagerScorer:
    """A reward manager as a scorer-table entry: ``start`` builds this member's instance (the
    reward router's address known by then), a call hands the record to ``run_single``."""

    wants_record = True  # Scoring passes the whole trajectory (``record=``)

    def __init__(self, cls: type, spec: ManagerSpec, *, name: str, compute_score: Callable[..., Any] | None,
                 reward_model_tokenizer: Any = None, version: str = ""):
        self.cls, self.spec, self.name = cls, spec, name
        self.compute_score = compute_score
        self.reward_model_tokenizer = reward_model_tokenizer
        self.reward_router_address: str | None = None
        self.version = version or str(getattr(sys.modules.get(cls.__module__), "VERSION", "0"))
        self.manager: Any = None
        self.tokenizer: Any = None

    def __repr__(self) -> str:
        return f"ManagerScorer({self.name!r}, {self.cls.__name__})"

    async def start(self) -> None:
        if self.manager is not None:
            return
        from omegaconf import OmegaConf

        self.tokenizer = await asyncio.to_thread(_policy_tokenizer, self.spec.tokenizer, self.name)
        config = OmegaConf.create(self.spec.config)
        try:
            self.manager = self.cls(config=config, tokenizer=self.tokenizer, compute_score=self.compute_score,
                                    reward_router_address=self.reward_router_address,
                                    reward_model_tokenizer=self.reward_model_tokenizer)
        except TypeError:  # a manager of the older signature: (config, tokenizer, compute_score)
            self.manager = self.cls(config=config, tokenizer=self.tokenizer, compute_score=self.compute_score)

    async def close(self) -> None:
        self.manager = None

    def set_share(self, fraction: float) -> None:
        """A manager's own limits are its own."""

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict[str, Any] | None = None, *, record: Any = None, **offered: Any) -> dict:
        if self.manager is None:
            raise RuntimeError(f"{self!r}: await start() first")
        if record is None:
            from streamrl.records import Trajectory

            record = Trajectory(id="", group_id="", group_size=1, policy_version=0, data_source=data_source,
                                prompt=offered.get("prompt") or "", response=solution_str,
                                ground_truth=ground_truth, extra_info=dict(extra_info or {}))
        out = await self.manager.run_single(record_data(record, self.tokenizer))
        if not isinstance(out, dict) or "reward_score" not in out:
            from streamrl.errors import Failure

            raise Failure("bad_score", f"{self.cls.__name__}.run_single returned no reward_score")
        info = {str(k): _plain(v) for k, v in (out.get("reward_extra_info") or {}).items() if k != "score"}
        return {**info, "score": _plain(out["reward_score"])}


def _policy_tokenizer(spec: str, name: str) -> Any:
    """The policy's tokenizer (``tiny``, a directory or a hub id), what verl's managers decode with."""
    from streamrl.policy import TINY_SPEC, byte_tokenizer
    from streamrl.scorers.loader import load_tokenizer

    if spec == TINY_SPEC:
        return byte_tokenizer()
    try:
        return load_tokenizer(spec.removeprefix("file://"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config field 'reward.scorers.{name}.manager.tokenizer': cannot load the policy's "
                          f"tokenizer {spec!r}: {exc}") from None


def bind_reward_kwargs(fn: Callable[..., Any], reward_kwargs: dict[str, Any]) -> Callable[..., Any]:
    """verl's custom reward function as a manager gets it: ``reward_kwargs`` merged into every
    call, winning over the call's own (``verl.trainer.ppo.reward._call_with_kwargs``); an async
    function stays async (managers test ``inspect.iscoroutinefunction``)."""
    if inspect.iscoroutinefunction(fn):
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            return await fn(*args, **{**kwargs, **reward_kwargs})
        return functools.update_wrapper(call_async, fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{**kwargs, **reward_kwargs})
    return functools.update_wrapper(call, fn)
