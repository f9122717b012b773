"""A rollout worker: a member of the consumer group on the prompts topic that turns each
``Prompt`` into ``group_size`` trajectories on the rollouts topic.

It composes the pieces of this package around the bus's ``StageLoop`` (which owns consuming,
dead letters for malformed prompts, commit-after-ack and back-pressure):

    prompt ─► staleness gate (hold while too far ahead) ─► load a newer policy version if one
    was announced ─► generate the group (multi-turn with an interaction, if configured; or the
    prompt's agent loop, ``rollout.agent``) ─►
    trajectories stamped with version and timings ─► rollouts

A backend that is down holds the prompt and retries (the loop's back-pressure stops fetching);
a backend that refuses a prompt for good (too long, say) sends it to dead letters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from streamrl import metrics
from streamrl.bus import Bus, Message, StageLoop
from streamrl.chat import ChatRenderer
from streamrl.errors import Failure, StreamrlError
from streamrl.records import PROMPTS, ROLLOUTS, DeadLetter, Prompt, Trajectory
from streamrl.rollout.backends import (Backend, BackendError, BackendUnavailable, SamplingParams,
                                       WeightLoadError, make_backend)
from streamrl.rollout.agent_loops import AgentLoops
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.episode import run_group
from streamrl.rollout.multiturn import MultiTurn
from streamrl.rollout.gate import StalenessGate
from streamrl.rollout.follower import PolicyFollower

if TYPE_CHECKING:
    from streamrl.learner.config import LearnerConfig

log = logging.getLogger(__name__)

STAGE = "rollout"


class RolloutSections(Protocol):
    """What a rollout worker reads of the pipeline's config (a ``PipelineConfig`` is one): its own
    section, and where the learner writes weights (the only paths it loads from)."""

    rollout: RolloutConfig
    learner: "LearnerConfig"
_RETRY_MAX_S = 30.0


def prompt_position(msg: Message) -> int:
    """Where a prompt's group goes on ``rollouts``: its partition plus its offset on ``prompts``,
    modulo the partitions of ``rollouts`` (``Producer.send``'s ``spread``).

    Why not the key's hash, as Kafka's default partitioner would: every trajectory of a prompt
    then landed on the partition number its prompt came from, and librdkafka hands a worker one
    prompts partition's backlog at a time, so a version's trajectories all sat on one rollouts
    partition and one reward member scored everything (issue 36). Consecutive prompts of a
    partition go round the rollouts partitions instead, whatever order a worker reads in: even
    to a group, and every version spans them all. A group stays whole (one prompt, one
    partition), and a prompt read again (a worker restarted before committing it) sends its
    group where it went the first time. The Kafka key stays the ``group_id``."""
    return msg.partition + msg.offset


class RolloutWorker:
    name: ClassVar[str] = STAGE

    def __init__(self, bus: Bus, cfg: RolloutConfig, backend: Backend | None = None):
        self.bus, self.cfg = bus, cfg.validate()
        # policy servers this worker starts itself (rollout.servers_launch): their URLs join the fleet
        self.servers = launch_servers(cfg) if backend is None else None
        if self.servers is not None:
            cfg = dataclasses.replace(cfg, servers=[*cfg.servers, *self.servers.urls("policy")])
            self.cfg = cfg
        self.backend = backend or make_backend(cfg)
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                     top_p=cfg.top_p, ignore_eos=cfg.ignore_eos)
        self.renderer = ChatRenderer(self.backend.tokenizer)
        # interactions (per sample, by interaction_kwargs.name) and tools, loaded before the
        # first prompt: a bad config file or class fails at start, naming the field
        self.multi_turn = MultiTurn.from_config(cfg)
        # verl's agent loops (rollout.agent): the classes of its config imported now, so a bad
        # entry fails at start; a prompt whose agent_name names one runs it
        self.agents = AgentLoops(cfg, tools=[t.tool for t in self.multi_turn.tools] if self.multi_turn else None)
        self.follower = PolicyFollower(bus, STAGE)
        self.gate = StalenessGate(bus, self.follower, max_staleness=cfg.max_staleness,
                                  per_version=cfg.trajectories_per_version,
                                  baseline=cfg.gate_baseline, poll_s=cfg.gate_poll_s)
        # each trajectory's gate reservation goes back when the broker has acknowledged it (or
        # refused it: then the prompt is not committed and is generated again)
        self.producer = bus.producer(STAGE, on_delivery=self._delivered)
        self.group = cfg.group or bus.topic(STAGE)
        self.loop = StageLoop(bus, stage=STAGE, source=PROMPTS, group=self.group, handle=self.handle,
                              max_in_flight=cfg.max_in_flight, producer=self.producer, spread=prompt_position)
        self._loaded_offset = -1  # policy-topic offset of the version in use (-1: the startup weights)
        self.lineage: str | None = None  # the training line of the weights in use
        self._load_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self.fatal: str | None = None  # why the worker stopped on its own (its servers cannot follow)
        self._label = self.backend.name
        if not self.backend.can_load_weights and cfg.follow_policy:
            log.warning("the %s backend cannot load weights: trajectories are stamped version %d",
                        self.backend.name, self.backend.version)
        metrics.ROLLOUT_POLICY_VERSION.set(self.backend.version)
        _refused(-1, None)

    @classmethod
    def from_config(cls, cfg: "RolloutSections", bus: Bus) -> "RolloutWorker":
        """Loads the policy into the backend: before the first prompt is taken."""
        rollout = cfg.rollout
        if not rollout.weights_prefixes:  # where this config's learner writes (and uploads) weights
            prefixes = [cfg.learner.weights_dir, *([cfg.learner.weights_uri] if cfg.learner.weights_uri else [])]
            rollout = dataclasses.replace(rollout, weights_prefixes=prefixes)
        lora = cfg.learner.lora
        if rollout.servers_launch.backend and lora.enabled and not lora.merge_for_servers:
            rollout = dataclasses.replace(rollout, servers_launch=with_lora(rollout.servers_launch, lora.rank))
        return cls(bus, rollout)

    def validate(self) -> None:
        self.cfg.validate()

    def describe(self) -> str:
        return f"backend {self.cfg.backend}, policy {self.cfg.policy}, group {self.group}"

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Work until ``stop`` is set (or ``stop()`` is called), then drain and leave the group."""
        async with contextlib.AsyncExitStack() as stack:
            if self.servers is not None:  # healthy before the first prompt; stopped last
                stack.push_async_callback(self.servers.close)
                await self.servers.start()
            stack.push_async_callback(self.backend.close)
            fleet = getattr(self.backend, "fleet", None)
            if fleet is not None and (len(fleet.members) > 1 or self.backend.can_load_weights):
                status = asyncio.create_task(_log_fleet_status(fleet))
                stack.callback(status.cancel)
            if self.backend.can_load_weights and (fleet is not None or self.cfg.on_update == "partial"):
                # servers load in the background: hand them each version as it is announced,
                # not only when the next prompt starts (requests in flight drain, abort or are
                # continued now); a local engine under partial loads between decoding chunks
                follow = asyncio.create_task(self._follow_announcements())
                stack.callback(follow.cancel)
            for part in (self.producer, self.follower, self.gate):  # stopped in reverse order
                stack.push_async_callback(part.stop)
                await part.start()
            await self.sync_weights()  # start on the learner's current version
            # the banner named the startup weights (cfg.policy); on a resumed run these are not
            # the ones that generate (the stage log's level hides the load's INFO line)
            print(f"{STAGE}: generating with policy version {self.backend.version}", flush=True)
            loop_task = asyncio.create_task(self.loop.run())
            waiters = [asyncio.create_task(self._stopping.wait())]
            if stop is not None:
                waiters.append(asyncio.create_task(stop.wait()))
            try:
                await asyncio.wait([loop_task, *waiters], return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.stop()
                self.loop.stop()
                for w in waiters:
                    w.cancel()
                await loop_task
        if self.fatal:
            raise StreamrlError(f"rollout: {self.fatal}")

    def stop(self) -> None:
        self._stopping.set()
        self.gate.stopping.set()

    async def _follow_announcements(self, poll_s: float = 0.1) -> None:
        fleet = getattr(self.backend, "fleet", None)
        while True:
            await self.sync_weights()
            if fleet is not None and fleet.fatal:  # e.g. a server without LoRA for a LoRA learner
                self.fatal = fleet.fatal
                self.stop()
                return
            await asyncio.sleep(poll_s)

    async def sync_weights(self) -> float:
        """Load the learner's latest version if it is not the one in use; the seconds spent."""
        latest, offset = self.follower.latest, self.follower.latest_offset
        if (latest is None or offset == self._loaded_offset or not self.cfg.follow_policy
                or not self.backend.can_load_weights):
            return 0.0
        async with self._load_lock:
            if self.follower.latest_offset == self._loaded_offset:
                return 0.0
            latest, offset = self.follower.latest, self.follower.latest_offset
            self._loaded_offset = offset  # a version that fails to load is not retried
            if latest.weights_uri is None:
                if latest.version == 0:  # the initial weights, which this worker started from
                    self.lineage = latest.lineage
                    await self.backend.use_starting_weights(0)
                    return 0.0
                log.error("policy version %d has no weights_uri: keeping version %d",
                          latest.version, self.backend.version)
                _refused(latest.version, "no_uri")
                return 0.0
            if not all(weights_allowed(u, self.cfg.weights_prefixes) for u in (latest.weights_uri, latest.base_uri) if u):
                log.error("policy version %d refused: weights_uri %r is not under rollout.weights_prefixes %s; "
                          "keeping version %d", latest.version, latest.weights_uri, self.cfg.weights_prefixes,
                          self.backend.version)
                _refused(latest.version, "not_allowed")
                return 0.0
            try:
                took = await self.backend.load_weights(latest.weights_uri, latest.version, latest.base_uri)
            except (WeightLoadError, OSError) as exc:
                log.error("policy version %d: %s; keeping version %d", latest.version, exc, self.backend.version)
                _refused(latest.version, "load_failed")
                return 0.0
            _refused(-1, None)
            self.lineage = latest.lineage
            log.info("loaded policy version %d in %.2fs", latest.version, took)
            metrics.ROLLOUT_WEIGHT_LOAD_SECONDS.observe(took)
            metrics.ROLLOUT_POLICY_VERSION.set(latest.version)
            return took

    def _delivered(self, topic: str, error: BaseException | None) -> None:
        if topic == ROLLOUTS.name:
            self.gate.release(1)

    async def handle(self, prompt: Prompt, msg: Message) -> list[Trajectory | DeadLetter]:
        metrics.ROLLOUT_PROMPTS.labels(self._label).inc()
        n = self.cfg.group_size or prompt.group_size
        n_all = n + 1 if self.cfg.greedy_baseline else n  # (ReMax's greedy response counts in the gate)
        gate_s = await self.gate.acquire(n_all)
        load_s = 0.0

        async def before_turn() -> None:
            nonlocal load_s
            load_s += await self.sync_weights()

        try:
            started = time.monotonic()
            await before_turn()  # the newest weights before the first turn, and their line
            lineage = self.lineage
            trajectories = await self._generate(prompt, n, before_turn)
            took = time.monotonic() - started
        except BaseException:
            self.gate.release(n_all)
            raise
        # the reservation is released trajectory by trajectory as the broker acknowledges them
        # (``_delivered``): only then do they count in the topic's end offsets
        tokens = 0
        for t in trajectories:
            t.timings.update(gate_wait_s=gate_s, weight_load_s=load_s)
            t.lineage = lineage
            mask = t.array("response_mask")
            ids = t.array("response_ids")
            tokens += int(mask.sum()) if mask is not None else (len(ids) if ids is not None else 0)
        metrics.ROLLOUT_GENERATION_SECONDS.labels(self._label).observe(took - load_s)
        metrics.ROLLOUT_TOKENS.labels(self._label).inc(tokens)
        metrics.ROLLOUT_TRAJECTORIES.labels(self._label).inc(len(trajectories))
        return self._bound_span(trajectories)

    def _bound_span(self, trajectories: list[Trajectory]) -> list[Trajectory | DeadLetter]:
        """Each trajectory whose tokens span more than ``rollout.max_span`` versions as a dead
        letter ``stale`` (its bytes, as if read from rollouts: the learner counts its group's
        member lost and settles the group). Its gate reservation goes back now: it never
        reaches the rollouts topic, and the gate does not count this stage's dead letters."""
        if not self.cfg.max_span:
            return list(trajectories)
        out: list[Trajectory | DeadLetter] = []
        for t in trajectories:
            span = trajectory_span(t)
            if span <= self.cfg.max_span:
                out.append(t)
                continue
            detail = (f"tokens span {span} policy versions (oldest {t.policy_version}), rollout.max_span "
                      f"{self.cfg.max_span}")
            out.append(DeadLetter.for_message(
                stage=STAGE, reason="stale", detail=detail, topic=self.bus.topic(ROLLOUTS.name), partition=None,
                offset=None, key=t.key, value=t.encode(self.bus.config.max_record_bytes), record_id=t.id))
            self.gate.release(1)
            metrics.ROLLOUT_SPAN_DROPPED.inc()
            metrics.BUS_DEADLETTERS.labels(STAGE, "stale").inc()
            log.info("dead letter from %s: stale %s", STAGE, detail)
        return out

    async def _generate(self, prompt: Prompt, n: int, before_turn: Any) -> list[Trajectory]:
        """The group's trajectories. A backend outage holds the prompt: retried without end,
        1 s doubling to ``_RETRY_MAX_S`` apart, until the backend answers or the worker stops."""

        def held(state: RetryCallState) -> None:
            metrics.ROLLOUT_BACKEND_UNAVAILABLE.labels(self._label).inc()
            log.warning("backend unavailable (%s); holding the prompt, retrying in %.0fs",
                        state.outcome.exception(), state.next_action.sleep)

        retrying = AsyncRetrying(retry=retry_if_exception_type(BackendUnavailable), before_sleep=held,
                                 wait=wait_exponential(multiplier=1.0, max=_RETRY_MAX_S),
                                 sleep=self._wait_unless_stopping, reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    if self.agents.runs(prompt):
                        out = await self.agents.run_group(prompt, n, self.backend, self.params, before_turn)
                    else:
                        out = await run_group(prompt, n, self.backend, self.params, self.renderer,
                                              self.multi_turn, before_turn)
                    if self.cfg.greedy_baseline:
                        out += await self._greedy_baseline(prompt, n, before_turn)
                        for t in out:
                            t.group_size = n + 1
                    return out
        except BackendError as exc:
            raise Failure("backend_error", str(exc)) from None
        raise AssertionError("unreachable")

    async def _greedy_baseline(self, prompt: Prompt, n: int, before_turn: Any) -> list[Trajectory]:
        """ReMax's baseline: one greedy response to the prompt, marked ``baseline``, in the group
        (whose ``group_size`` then counts it: the learner waits for it as for any member)."""
        greedy = dataclasses.replace(self.params, temperature=0.0)
        if self.agents.runs(prompt):
            [base] = await self.agents.run_group(prompt, 1, self.backend, greedy, before_turn)
        else:
            [base] = await run_group(prompt, 1, self.backend, greedy, self.renderer, self.multi_turn, before_turn)
        base.id, base.baseline = f"{prompt.group_id}-baseline", True
        return [base]

    async def _wait_unless_stopping(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except asyncio.TimeoutError:
            return
        raise asyncio.CancelledError("worker stopping")


def trajectory_span(t: Trajectory) -> int:
    """The policy versions a trajectory's tokens span, oldest to newest (1: one version): from
    ``token_versions``, or for a text-only multi-turn one its turns' versions."""
    if t.token_versions:
        return t.versions().span
    turns = [m["policy_version"] for m in t.turns or () if isinstance(m.get("policy_version"), int)]
    return max(turns) - min(turns) + 1 if turns else 1


_REFUSALS = ("not_allowed", "no_uri", "load_failed")


def _refused(version: int, reason: str | None) -> None:
    """The weights gauge says which version was refused and why (all -1: none), so the run's
    status line names it; each refusal also counts as a load error."""
    for r in _REFUSALS:
        metrics.ROLLOUT_WEIGHTS_REFUSED.labels(r).set(version if r == reason else -1)
    if reason is not None:
        metrics.ROLLOUT_WEIGHT_LOAD_ERRORS.inc()

_STATUS_S = 30.0


async def _log_fleet_status(fleet: Any) -> None:
    """The fleet's status line in the worker's log, as its banner is (the default log level
    would hide an INFO line): at once when it changes (a server out, back, on a new version),
    else every ``_STATUS_S`` seconds. ``streamrl run``'s status line sums it up from the
    ``streamrl_rollout_servers`` gauge."""
    last, logged = "", 0.0
    while True:
        line = fleet.status()
        if line != last or time.monotonic() - logged >= _STATUS_S:
            print(line, flush=True)
            last, logged = line, time.monotonic()
        await asyncio.sleep(1.0)


def launch_servers(cfg: RolloutConfig) -> Any:
    """The policy servers of ``rollout.servers_launch`` (the reward stage's supervision,
    ``streamrl.servers.processes``), or None when none are configured."""
    launch = cfg.servers_launch
    if not launch.backend:
        return None
    from streamrl.servers.processes import ServerConfig
    from streamrl.servers.processes import ServerProcesses

    spec = ServerConfig(name="policy", model=cfg.policy, backend=launch.backend, replicas=launch.replicas,
                        task="generate", gpus_per_replica=launch.gpus_per_replica, port=launch.port,
                        host=launch.host, args=[*server_flags(launch.backend, cfg), *launch.args],
                        env=dict(launch.env), startup_timeout_s=launch.startup_timeout_s,
                        restart_backoff_s=launch.restart_backoff_s, restart_backoff_max_s=launch.restart_backoff_max_s)
    return ServerProcesses([spec], role="policy", field_name="rollout.servers_launch")


def server_flags(backend: str, cfg: RolloutConfig) -> list[str]:
    """What a launched policy server is started with beside its model: the policy's config
    overrides (``rollout.override_config``, verl's model.override_config: ``vllm serve
    --hf-overrides JSON``, ``sglang.launch_server --json-model-override-args JSON``) and its
    quantisation (``rollout.quantization``: ``--quantization Q`` in both; vLLM's
    ``quantization_config_file`` inside ``--hf-overrides``, where vLLM reads it), and the
    engine's keyword arguments (``servers_launch.engine_kwargs``, verl's rollout.engine_kwargs)."""
    from streamrl.policy import model_overrides

    overrides = model_overrides(cfg.override_config)
    if cfg.quantization_config_file:  # (validated: vLLM only)
        overrides = {**overrides, "quantization_config_file": cfg.quantization_config_file}
    from streamrl.servers.processes import kwargs_flags

    flags = ["--quantization", cfg.quantization] if cfg.quantization else []
    if overrides:
        flags += ["--hf-overrides" if backend == "vllm" else "--json-model-override-args",
                  json.dumps(overrides, sort_keys=True)]
    return flags + kwargs_flags(cfg.servers_launch.engine_kwargs)


#: the LoRA ranks ``vllm serve --max-lora-rank`` accepts
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def with_lora(launch: Any, rank: int) -> Any:
    """``rollout.servers_launch`` for a learner that publishes LoRA adapters (``learner.lora``):
    the servers it starts take adapters at run time (vLLM: ``--enable-lora``, a
    ``--max-lora-rank`` it accepts, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; SGLang:
    ``--enable-lora``, ``--max-lora-rank``, every target module). Flags already given are kept."""
    args, env = list(launch.args), dict(launch.env)
    if "--enable-lora" not in args:
        args.append("--enable-lora")
    if "--max-lora-rank" not in args:
        allowed = next((r for r in VLLM_LORA_RANKS if r >= rank), rank) if launch.backend == "vllm" else rank
        args += ["--max-lora-rank", str(allowed)]
    if launch.backend == "vllm":
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    elif "--lora-target-modules" not in args:
        args += ["--lora-target-modules", "all"]
    return dataclasses.replace(launch, args=args, env=env)


def weights_allowed(uri: str, prefixes: list[str]) -> bool:
    """``uri`` lies under one of ``prefixes`` (local paths compared resolved, so ``..`` and links
    cannot leave them; other URIs by prefix). No prefixes: anything (tests, custom setups)."""
    if not prefixes:
        return True
    if "://" in uri and not uri.startswith("file://"):
        return any(uri == p or uri.startswith(p.rstrip("/") + "/") for p in prefixes if "://" in p)
    path = Path(uri.removeprefix("file://")).resolve()
    return any(path.is_relative_to(Path(p.removeprefix("file://")).resolve()) for p in prefixes if "://" not in p
               or p.startswith("file://"))

