"""Where ``streamrl run --launcher ray`` may put its stages, worked out before Ray is asked: each
stage's ask (``run.ray.resources`` over the defaults), how many actors of each may run, the
asks as Ray actor options, whether a cluster's nodes can hold them all (one line naming the
stage and the config field when not), and the environment each stage receives. Pure: it
imports no Ray, so ``streamrl run`` checks a config, and the tests check placements, without a
cluster."""

from __future__ import annotations

import os
import re
from typing import Any

from streamrl.errors import ConfigError

#: the stages, in the order ``streamrl run`` starts them (the placement check places them so)
STAGES = ("learner", "reward", "teacher", "rollout", "feed")
#: what each stage's actor asks for unless ``run.ray.resources.<stage>`` says otherwise: the
#: learner computes (add ``num_gpus`` on GPU nodes); a rollout worker with a local engine
#: (transformers, vllm) computes; reward members and the feed wait on I/O (judges, reward-model
#: servers, the broker) and ask for a fraction of a CPU
DEFAULT_RESOURCES: dict[str, dict[str, float]] = {
    "learner": {"num_cpus": 1.0},
    "rollout": {"num_cpus": 1.0},
    "reward": {"num_cpus": 0.25},
    "teacher": {"num_cpus": 1.0},  # a local teacher model computes (the openai backend waits: REMOTE_ROLLOUT's ask)
    "feed": {"num_cpus": 0.25},
}
#: a rollout worker whose backend is a server (``rollout.backend: openai``) waits on it
REMOTE_ROLLOUT: dict[str, float] = {"num_cpus": 0.25}
_RAY_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory_gb": "memory"}
_GIB = 2 ** 30
EPS = 1e-6
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# -- what the stages ask for, and whether the cluster can hold them -----------------------------
def stage_resources(cfg: Any) -> dict[str, dict[str, float]]:
    """Each stage's ask: ``DEFAULT_RESOURCES`` (``REMOTE_ROLLOUT`` for the openai backend) with
    ``run.ray.resources`` over it; a bad entry is a ``ConfigError`` naming it."""
    given = cfg.run.ray.resources
    for kind, ask in given.items():
        if kind not in STAGES:
            raise ConfigError(f"config field 'run.ray.resources.{kind}': not a stage (one of {', '.join(STAGES)})")
        for key, value in ask.items():
            if not value >= 0:
                raise ConfigError(f"config field 'run.ray.resources.{kind}.{key}': must be >= 0 (got {value})")
    out = {}
    for kind in STAGES:
        remote = (kind == "rollout" and cfg.rollout.backend == "openai"
                  or kind == "teacher" and cfg.distillation.enabled
                  and all(t.config.backend == "openai" for t in cfg.distillation.teachers(cfg.teacher).values()))
        base = REMOTE_ROLLOUT if remote else DEFAULT_RESOURCES[kind]
        out[kind] = {**base, **given.get(kind, {})}
    return out


def stage_counts(cfg: Any) -> dict[str, int]:
    """How many actors of each stage ``streamrl run`` may start (the reward group at its
    autoscaling maximum, every teacher group's members)."""
    run = cfg.run
    distill = cfg.distillation
    teachers = sum(max(t.members or run.teacher_members, run.teacher_autoscale.max_members)
                   for t in distill.teachers(cfg.teacher).values()) \
        if distill.enabled else 0  # every teacher's group at its most (issue 59: the single teacher was left out)
    rewarded = not distill.enabled or distill.distillation_loss.use_task_rewards  # else no reward group runs
    return {"learner": cfg.learner.parallel.nproc,
            "reward": max(run.reward_members, run.autoscale.max_members) if rewarded else 0,
            "teacher": teachers, "rollout": run.rollout_workers, "feed": 1}


def actor_options(ask: dict[str, float]) -> dict[str, Any]:
    """A stage's ask as Ray actor options."""
    options: dict[str, Any] = {"num_cpus": ask.get("num_cpus", 0.0), "num_gpus": ask.get("num_gpus", 0.0)}
    if ask.get("memory_gb"):
        options["memory"] = int(ask["memory_gb"] * _GIB)
    custom = {key: value for key, value in ask.items() if key not in _RAY_NAMES and value}
    if custom:
        options["resources"] = custom
    return options


def demand_of(ask: dict[str, float]) -> dict[str, tuple[float, str]]:
    """Ray resource name -> (amount in Ray's units, the config key)."""
    return {_RAY_NAMES.get(key, key): (value * _GIB if key == "memory_gb" else value, key)
            for key, value in ask.items() if value > 0}


def describe(resource: str, amount: float) -> str:
    """``1 CPU``, ``0.25 CPU``, ``2 GPUs``, ``4 GiB of memory``, ``1 of the resource 'x'``."""
    if resource == "memory":
        return f"{amount / _GIB:.3g} GiB of memory"
    n = f"{amount:g}"
    if resource in ("CPU", "GPU"):
        return f"{n} {resource}{'s' if amount > 1 else ''}"
    return f"{n} of the resource {resource!r}"


def check_placement(asks: dict[str, dict[str, float]], counts: dict[str, int],
                    nodes: list[dict[str, float]], scaled_from: int | None = None) -> str | None:
    """None when every stage can be placed on ``nodes`` (each node's resources, in Ray's names);
    else one line naming the first stage that cannot, why, and the field to change. Each stage
    is held against the largest node, then all are placed first-fit in start order, as Ray
    places them one after the other."""
    for kind in STAGES:
        if not counts.get(kind):
            continue
        for resource, (amount, key) in demand_of(asks[kind]).items():
            largest = max((node.get(resource, 0.0) for node in nodes), default=0.0)
            if largest + EPS < amount:
                has = ("the cluster has none" if largest <= 0
                       else f"the largest node has {describe(resource, largest)}")
                return f"stage '{kind}' asks for {describe(resource, amount)}; {has} (run.ray.resources.{kind}.{key})"
    free = [dict(node) for node in nodes]
    placed: list[str] = []
    for kind in STAGES:
        demand = demand_of(asks[kind])
        for i in range(counts.get(kind, 0)):
            name = f"{kind}-{i}" if kind in ("reward", "teacher", "rollout") else kind
            node = next((f for f in free if all(f.get(r, 0.0) + EPS >= a for r, (a, _) in demand.items())), None)
            if node is not None:
                for resource, (amount, _) in demand.items():
                    node[resource] -= amount
                placed.append(name)
                continue
            short = [r for r, (a, _) in demand.items() if not any(f.get(r, 0.0) + EPS >= a for f in free)]
            resource = short[0] if short else next(iter(demand))
            amount, key = demand[resource]
            total = sum(node.get(resource, 0.0) for node in nodes)
            used = total - sum(f.get(resource, 0.0) for f in free)
            why = (f"the stages before it ({_listed(placed)}) take {describe(resource, used)} of the cluster's "
                   f"{describe(resource, total)}, and it asks for {describe(resource, amount)}" if short else
                   f"no node has all of {', '.join(describe(r, a) for r, (a, _) in demand.items())} free "
                   f"once {_listed(placed)} are placed")
            more = (f"; the reward group may grow to run.autoscale.max_members={counts['reward']}"
                    if kind == "reward" and scaled_from is not None and i >= scaled_from else "")
            return f"stage '{name}' cannot be placed: {why} (run.ray.resources.{kind}.{key}, or a bigger cluster{more})"
    return None


def _listed(names: list[str]) -> str:
    """``learner, reward-0..5, rollout-0``: runs of one stage's members collapsed."""
    runs: list[list[str]] = []
    for name in names:
        kind = name.rsplit("-", 1)[0]
        if runs and runs[-1][0].rsplit("-", 1)[0] == kind and "-" in name:
            runs[-1].append(name)
        else:
            runs.append([name])
    return ", ".join(", ".join(r) if len(r) < 3 else f"{r[0]}..{r[-1].rsplit('-', 1)[1]}" for r in runs)


def stage_env(cfg: Any) -> dict[str, str]:
    """The variables named in ``run.ray.env_vars`` (and the SASL password's, when SASL is on),
    with their values from this process's environment. Errors name the variable, never a value."""
    names = list(cfg.run.ray.env_vars)
    if cfg.bus.sasl_mechanism and cfg.bus.sasl_password_env and cfg.bus.sasl_password_env not in names:
        names.append(cfg.bus.sasl_password_env)
    env = {}
    for i, name in enumerate(names):
        if not _ENV_NAME.fullmatch(name):  # perhaps a value pasted by mistake: not echoed
            raise ConfigError(f"config field 'run.ray.env_vars': entry {i} is not a variable name "
                              f"(give NAMES; their values are read from this environment)")
        if name not in os.environ:
            field = "run.ray.env_vars" if name in cfg.run.ray.env_vars else "bus.sasl_password_env"
            raise ConfigError(f"config field {field!r}: {name} is not set in this environment")
        env[name] = os.environ[name]
    return env
