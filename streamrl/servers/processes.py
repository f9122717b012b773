"""Servers streamrl launches itself: the reward stage's reward models (``reward.servers``) and
the rollout workers' policy servers (``rollout.servers_launch``, ``role="policy"``).

verl's reward loop starts its reward-model servers (vLLM or SGLang replicas) next to the
trainer and puts a router in front of them; a streamrl reward member does the same for its own
scorers, so a config can say "this RM, two replicas" instead of running servers by hand::

    reward:
      servers:
        - {name: rm, model: Skywork/Skywork-Reward-V2-Llama-3.1-8B, backend: vllm, replicas: 2,
           gpus_per_replica: 1, args: [--max-model-len, "8192"]}
      scorers:
        skywork: {type: model, data_sources: [chat], model: {server: rm}}

What happens, in ``ServerProcesses``:

- **build** (``for_table``, when the scorer table is built): each entry is checked (a bad one is
  a ``ConfigError`` naming ``reward.servers[i].<field>``), each replica gets its port (``port +
  i``, or a free one) and its devices (``CUDA_VISIBLE_DEVICES``: replica i takes devices
  ``[i*g, (i+1)*g)`` of the visible ones), and every model entry that names a server
  (``model.server``) gets the replicas' URLs registered with its router;
- **start** (``ScorerTable.start``, before any scorer starts): every replica is spawned as a
  local process (its own session, so its children go with it) and must answer ``GET /health``
  within ``startup_timeout_s``; one that exits or times out fails the start with the tail of its
  log (the stage does not run half-served);
- **supervision**: a replica that dies is restarted on the same port after
  ``restart_backoff_s``, doubling (to ``restart_backoff_max_s``) while it keeps dying within a
  minute of its start. Meanwhile the router ejects it (its requests go to the other replicas,
  or, with none left, the stage holds the records: never scored 0) and re-admits it when its
  health check passes again;
- **close** (``ScorerTable.close``): SIGTERM to each replica's process group, SIGKILL after
  ``STOP_GRACE_S``.

The commands (``server_argv``): ``vllm serve MODEL --runner pooling --tensor-parallel-size G``
(vLLM picks the classification pooler from a ``*ForSequenceClassification`` architecture),
``python -m sglang.launch_server --model-path MODEL --is-embedding --tp-size G`` (SGLang serves
reward models as embedding models, docs "Reward models"), ``trtllm-serve MODEL --tp_size G
--backend pytorch`` (TensorRT-LLM's OpenAI-compatible server: generation only, a generative
reward model or a policy that follows no learner, since it takes no weights from disk), and ``python -m
streamrl.scorers.rm_server --model MODEL`` (streamrl's own transformers server, vLLM's
``/classify`` API, CPU or CUDA: the backend the tests run end to end). ``args`` are appended
as given.

Replicas are local processes of this reward member: on Ray, the reward member is itself an
actor and its servers run on its node (placing replicas as their own Ray actors with GPU
resources is a follow-up). Two members on one host must not share fixed ports: use ``port: 0``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from streamrl.errors import ConfigError, MissingExtra, StreamrlError
from streamrl.net import free_port

log = logging.getLogger(__name__)

SERVER_BACKENDS = ("vllm", "sglang", "trtllm", "transformers")
STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL
HEALTH_POLL_S = 0.25
STABLE_AFTER_S = 60.0  # a replica up this long has its restart backoff reset
_SECRET_FLAGS = ("key", "token", "secret", "password")
VLLM_WORKER_EXTENSION = "streamrl.rollout.vllm_extension.WeightFollowerExtension"
#: what a policy server's environment needs: vLLM serves ``/collective_rpc`` only in dev mode
POLICY_ENV = {"vllm": {"VLLM_SERVER_DEV_MODE": "1"}, "sglang": {}, "trtllm": {}}


@dataclass
class ServerConfig:
    """A reward-model server the reward stage launches and supervises itself (one entry of
    ``reward.servers``; ``streamrl.servers.processes``): ``replicas`` local processes, each
    health-checked before the stage scores, restarted with backoff when it dies, stopped with
    the stage. A model entry scores on it with ``model: {server: NAME}`` instead of ``urls``."""

    name: str = ""  # what model entries name as model.server (required, unique)
    model: str = ""  # the model directory or hub id the server loads
    # vllm (vllm serve) | sglang (sglang.launch_server) | trtllm (trtllm-serve; task generate only)
    # | transformers (streamrl's own, CPU or CUDA)
    backend: str = "vllm"
    replicas: int = 1  # server processes, each on its own port and devices
    gpus_per_replica: int = 1  # CUDA devices per replica (tensor parallel); transformers: 0 = CPU
    port: int = 0  # the first replica's port, replica i on port + i; 0: free ports, picked at start
    host: str = "127.0.0.1"  # the interface the servers listen on
    args: list[str] = field(default_factory=list)  # extra command-line arguments, appended as given
    # classify: a discriminative reward model (vLLM --runner pooling, SGLang --is-embedding);
    # generate: served as its architecture says (vLLM's default runner): a generative reward
    # model's chat completions, which a function calls through reward.reward_router
    task: str = "classify"
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the server processes
    startup_timeout_s: float = 900.0  # to pass its first health check (model download and load)
    restart_backoff_s: float = 1.0  # first wait before restarting a replica that died; doubles
    restart_backoff_max_s: float = 60.0  # the longest wait between restarts


class _DiedYoung(Exception):
    """A replica's process ended before ``STABLE_AFTER_S``: restarted after a growing backoff."""

    def __init__(self, code: int | None, lived: float):
        super().__init__(f"exited with status {code} after {lived:.1f} s")
        self.code, self.lived = code, lived


class ServerStartError(StreamrlError):
    """A reward server did not come up: it exited, or passed no health check in time."""


def validate_servers(specs: list[ServerConfig], field_name: str = "reward.servers") -> None:
    """``ConfigError`` naming ``reward.servers[i].<field>`` (``field_name``) for the first bad entry."""
    seen: set[str] = set()
    ports: dict[int, str] = {}
    for i, s in enumerate(specs):
        where = f"config field '{field_name}[{i}]"
        if not s.name:
            raise ConfigError(f"{where}.name': every reward server needs a name (model entries "
                              f"refer to it as model.server)")
        if s.name in seen:
            raise ConfigError(f"{where}.name': {s.name!r} names two reward servers")
        seen.add(s.name)
        if not s.model:
            raise ConfigError(f"{where}.model': the model directory or hub id the server loads")
        if s.backend not in SERVER_BACKENDS:
            raise ConfigError(f"{where}.backend': {s.backend!r} is not one of {SERVER_BACKENDS}")
        if s.replicas < 1:
            raise ConfigError(f"{where}.replicas': must be at least 1")
        if s.gpus_per_replica < (0 if s.backend == "transformers" else 1):
            raise ConfigError(f"{where}.gpus_per_replica': a {s.backend} server needs at least "
                              f"{0 if s.backend == 'transformers' else 1}")
        if s.port and not 1 <= s.port <= 65535 - (s.replicas - 1):
            raise ConfigError(f"{where}.port': {s.port} (+{s.replicas - 1} replicas) is not a TCP port")
        for p in range(s.port, s.port + s.replicas) if s.port else ():
            if p in ports:
                raise ConfigError(f"{where}.port': replicas of {s.name!r} and {ports[p]!r} would both "
                                  f"listen on port {p}")
            ports[p] = s.name
        if s.startup_timeout_s <= 0 or s.restart_backoff_s < 0 or s.restart_backoff_max_s < s.restart_backoff_s:
            raise ConfigError(f"{where}.startup_timeout_s': needs startup_timeout_s > 0 and "
                              f"0 <= restart_backoff_s <= restart_backoff_max_s")
        if s.task not in ("classify", "generate"):
            raise ConfigError(f"{where}.task': {s.task!r} is not classify or generate")
        if s.task == "classify" and s.backend == "trtllm":
            raise ConfigError(f"{where}.task': trtllm-serve serves generation (a generative reward model, task "
                              f"generate), not a classifier's scores")
        if s.task == "generate" and s.backend == "transformers":
            raise ConfigError(f"{where}.task': streamrl's transformers server classifies only: a generative "
                              f"reward model is served by vllm or sglang")
        if not all(isinstance(a, str) for a in s.args):
            raise ConfigError(f"{where}.args': command-line arguments are strings")


def server_argv(spec: ServerConfig, port: int, role: str = "reward") -> list[str]:
    """The command line of one replica of ``spec`` listening on ``port``. ``role`` "policy": a
    generation server the rollout fleet updates (``streamrl.rollout.fleet``): vLLM with
    streamrl's worker extension (its ``/collective_rpc`` needs ``VLLM_SERVER_DEV_MODE=1``, set
    in ``policy_env``), SGLang as it is (``/update_weights_from_disk`` is always on)."""
    g = str(spec.gpus_per_replica)
    if spec.backend == "trtllm":  # TensorRT-LLM's OpenAI-compatible server, its PyTorch backend
        return [_executable("trtllm-serve"), spec.model, "--host", spec.host, "--port", str(port), "--tp_size", g,
                "--backend", "pytorch", *spec.args]
    if role == "policy":
        if spec.backend == "vllm":
            return [_executable("vllm"), "serve", spec.model, "--host", spec.host, "--port", str(port),
                    "--tensor-parallel-size", g, "--worker-extension-cls", VLLM_WORKER_EXTENSION, *spec.args]
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model,
                "--host", spec.host, "--port", str(port), "--tp-size", g, *spec.args]
    pooling = spec.task == "classify"  # a generative reward model serves chat completions
    if spec.backend == "vllm":
        return [_executable("vllm"), "serve", spec.model, "--host", spec.host, "--port", str(port),
                *(["--runner", "pooling"] if pooling else []), "--tensor-parallel-size", g, *spec.args]
    if spec.backend == "sglang":
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model,
                *(["--is-embedding"] if pooling else []), "--host", spec.host, "--port", str(port), "--tp-size", g,
                *spec.args]
    device = "cuda" if spec.gpus_per_replica > 0 else "cpu"
    return [sys.executable, "-m", "streamrl.scorers.rm_server", "--model", spec.model,
            "--host", spec.host, "--port", str(port), "--device", device, *spec.args]


def kwargs_flags(kwargs: dict[str, Any]) -> list[str]:
    """An engine's keyword arguments (verl's ``rollout.engine_kwargs.<engine>``) as its server's
    flags: ``--key-with-dashes value``; true: the flag alone; false and null: left out (the
    server's default)."""
    out: list[str] = []
    for key, value in (kwargs or {}).items():
        if value is None:
            continue
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value, sort_keys=True)]
        else:
            out += [flag, str(value)]
    return out


def _executable(name: str) -> str:
    """``name`` (``vllm``, ``trtllm-serve``) on PATH, else the one beside this interpreter (a
    virtualenv's bin)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else name


def replica_devices(spec: ServerConfig, index: int, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` of replica ``index``: its ``gpus_per_replica`` devices out of
    those this process sees (``visible``: the parent's ``CUDA_VISIBLE_DEVICES``, None for all,
    numbered from 0). ``""`` (no GPU) for a CPU replica."""
    g = spec.gpus_per_replica
    if g == 0:
        return ""
    pool = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    wanted = range(index * g, (index + 1) * g)
    if pool is None:
        return ",".join(str(d) for d in wanted)
    if wanted.stop > len(pool):
        raise ConfigError(f"config field 'reward.servers.{spec.name}.gpus_per_replica': "
                          f"{spec.replicas} replicas x {g} GPUs, but CUDA_VISIBLE_DEVICES lists "
                          f"{len(pool)}")
    return ",".join(pool[d] for d in wanted)


def redacted(argv: Iterable[str]) -> str:
    """``argv`` for a log line: the value after a flag naming a key or token is hidden, as is
    a ``--flag=value`` of that kind."""
    out: list[str] = []
    hide = False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
            continue
        low = a.lower()
        if a.startswith("-") and any(s in low for s in _SECRET_FLAGS):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=***")
            else:
                out.append(a)
                hide = True
            continue
        out.append(a)
    return " ".join(out)


@dataclass
class Replica:
    """One server process: where it listens, how it is started, and its life so far."""

    spec: ServerConfig
    index: int
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    pids: list[int] = field(default_factory=list)  # every process started for it, in order

    @property
    def url(self) -> str:
        host = self.spec.host if self.spec.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    role: str = "reward"

    @property
    def label(self) -> str:
        return f"{self.role} server {self.spec.name!r} replica {self.index} ({self.url})"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return " | ".join(t.strip() for t in text if t.strip())[-2000:]


class ServerProcesses:
    """The reward servers of one reward member: built from ``reward.servers``, started and
    stopped with the scorer table, each replica supervised (restarted with backoff)."""

    def __init__(self, specs: list[ServerConfig], role: str = "reward", field_name: str = "reward.servers"):
        validate_servers(specs, field_name)
        self.role = role
        self.specs = {s.name: s for s in specs}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.replicas: dict[str, list[Replica]] = {}
        taken: set[int] = {s.port + i for s in specs if s.port for i in range(s.replicas)}
        for s in specs:
            ports = [s.port + i for i in range(s.replicas)] if s.port else []
            while len(ports) < s.replicas:  # free ports, none picked twice
                port = free_port(s.host)
                if port not in taken:
                    taken.add(port)
                    ports.append(port)
            self.replicas[s.name] = [
                Replica(s, i, port, server_argv(s, port, role), self._env(s, replica_devices(s, i, visible), role),
                        role=role)
                for i, port in enumerate(ports)]
        self._log_dir: Path | None = None
        self._supervisors: list[asyncio.Task] = []
        self._closing = False

    @staticmethod
    def _env(spec: ServerConfig, devices: str, role: str = "reward") -> dict[str, str]:
        # the replica's devices, unless the entry's own env says otherwise
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "PYTHONUNBUFFERED": "1"}
        if role == "policy":
            env.update(POLICY_ENV.get(spec.backend, {}))
        env.update({str(k): str(v) for k, v in spec.env.items()})
        return env

    @classmethod
    def for_table(cls, specs: list[ServerConfig], entries: dict[str, Any]) -> "ServerProcesses | None":
        """The servers of a scorer table, with every model entry that names one
        (``model.server``) attached to its replicas; None when there are none. An entry naming
        a server that is not in ``reward.servers`` is a ``ConfigError``."""
        servers = cls(specs) if specs else None
        for name, entry in entries.items():
            scorer = entry.scorer  # a model scorer has attach_server (its module is not imported here)
            if not hasattr(scorer, "attach_server") or not getattr(scorer.config, "server", ""):
                continue
            where = f"reward.scorers.{name}.model"
            wanted = scorer.config.server
            if servers is None or wanted not in servers.specs:
                known = sorted(servers.specs) if servers else []
                raise ConfigError(f"config field '{where}.server': {wanted!r} is not the name of a "
                                  f"reward.servers entry (known: {known})")
            spec = servers.specs[wanted]
            scorer.attach_server(servers.urls(wanted), spec.backend, spec.model, where)
        return servers

    def urls(self, name: str) -> list[str]:
        return [r.url for r in self.replicas[name]]

    def all_replicas(self) -> list[Replica]:
        return [r for rs in self.replicas.values() for r in rs]

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn every replica and wait until each passes a health check; then supervise them.
        Any replica failing to come up stops them all and raises ``ServerStartError``."""
        import aiohttp

        self._closing = False
        self._check_installed()
        self._log_dir = Path(tempfile.mkdtemp(prefix=f"streamrl-{self.role}-servers-"))
        replicas = self.all_replicas()
        try:
            for r in replicas:
                await self._spawn(r)
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(self._wait_healthy(session, r) for r in replicas))
        except BaseException:
            await self.close(keep_logs=True)  # the error names a log: leave it to be read
            raise
        self._supervisors = [asyncio.create_task(self._supervise(r), name=f"supervise:{r.label}")
                             for r in replicas]

    def _check_installed(self) -> None:
        import importlib.util

        for s in self.specs.values():
            if s.backend == "vllm" and not (shutil.which(self.replicas[s.name][0].argv[0])
                                            or Path(self.replicas[s.name][0].argv[0]).exists()):
                raise MissingExtra(f"reward server {s.name!r} (backend vllm) needs vllm: "
                                   f"pip install 'streamrl[vllm]'")
            if s.backend == "trtllm" and not (shutil.which(self.replicas[s.name][0].argv[0])
                                              or Path(self.replicas[s.name][0].argv[0]).exists()):
                raise MissingExtra(f"server {s.name!r} (backend trtllm) needs TensorRT-LLM's trtllm-serve: "
                                   f"pip install tensorrt-llm")
            if s.backend == "sglang" and importlib.util.find_spec("sglang") is None:
                raise MissingExtra(f"reward server {s.name!r} (backend sglang) needs sglang: "
                                   f"pip install 'sglang[all]'")

    async def _spawn(self, r: Replica) -> None:
        assert self._log_dir is not None
        r.log_path = self._log_dir / f"{r.spec.name}-{r.index}.log"
        with open(r.log_path, "ab") as out:
            out.write(f"--- {time.strftime('%H:%M:%S')} start: {redacted(r.argv)}\n".encode())
            out.flush()
            r.proc = await asyncio.create_subprocess_exec(
                *r.argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=r.env,
                start_new_session=True)
        r.started_at = time.monotonic()
        r.pids.append(r.proc.pid)
        log.info("started %s: pid %d, log %s: %s", r.label, r.proc.pid, r.log_path, redacted(r.argv))

    async def _wait_healthy(self, session: Any, r: Replica) -> None:
        import aiohttp

        deadline = time.monotonic() + r.spec.startup_timeout_s
        while True:
            assert r.proc is not None
            if r.proc.returncode is not None:
                raise ServerStartError(f"{r.label} exited with status {r.proc.returncode} before "
                                       f"it was healthy; its log ({r.log_path}) ends: {r.log_tail()}")
            try:
                async with session.get(r.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        log.info("%s is healthy after %.1f s", r.label, time.monotonic() - r.started_at)
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"{r.label} passed no health check within "
                                       f"{r.spec.startup_timeout_s:g} s (reward.servers "
                                       f"startup_timeout_s); its log ({r.log_path}) ends: {r.log_tail()}")
            await asyncio.sleep(HEALTH_POLL_S)

    async def _supervise(self, r: Replica) -> None:
        """Restart ``r`` whenever its process ends, after a backoff (tenacity's exponential,
        ``restart_backoff_s`` doubling to ``restart_backoff_max_s``) that grows while it keeps
        dying young; a replica that lived ``STABLE_AFTER_S`` starts over from the first backoff.
        The router's health checks take it out and back in meanwhile. ``close`` cancels it."""
        spec = r.spec

        def waiting(state: RetryCallState) -> None:
            exc = state.outcome.exception()
            if isinstance(exc, OSError):  # could not even exec: try again after the backoff
                log.error("restarting %s failed: %s", r.label, exc)
            else:
                log.warning("%s exited with status %s after %.1f s; restarting in %.1f s (log %s: %s)",
                            r.label, exc.code, exc.lived, state.next_action.sleep, r.log_path, r.log_tail(3))

        while not self._closing:
            retrying = AsyncRetrying(retry=retry_if_exception_type((_DiedYoung, OSError)), before_sleep=waiting,
                                     wait=wait_exponential(multiplier=spec.restart_backoff_s or 0.05,
                                                           max=spec.restart_backoff_max_s))
            async for attempt in retrying:
                with attempt:
                    assert r.proc is not None
                    if r.proc.returncode is not None:  # a restart (the first life was started by start())
                        await self._spawn(r)
                        r.restarts += 1
                    code = await r.proc.wait()
                    lived = time.monotonic() - r.started_at
                    if not self._closing and lived < STABLE_AFTER_S:
                        raise _DiedYoung(code, lived)
            if self._closing:
                return
            log.warning("%s exited with status %s after %.1f s; restarting in %.1f s (log %s: %s)", r.label,
                        r.proc.returncode, lived, spec.restart_backoff_s, r.log_path, r.log_tail(3))
            await asyncio.sleep(spec.restart_backoff_s)  # after a stable life: the first backoff again

    async def close(self, keep_logs: bool = False) -> None:
        """Stop supervising, then stop every replica: SIGTERM to its process group, SIGKILL
        after ``STOP_GRACE_S``. The replicas' logs go too, unless ``keep_logs``."""
        self._closing = True
        for t in self._supervisors:
            t.cancel()
        for t in self._supervisors:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._supervisors = []
        await asyncio.gather(*(self._stop(r) for r in self.all_replicas()))
        if self._log_dir is not None and not keep_logs:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    async def _stop(self, r: Replica) -> None:
        proc = r.proc
        if proc is None:
            return
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                log.warning("%s did not stop within %.0f s of SIGTERM; killing it", r.label, STOP_GRACE_S)
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of its group is left
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    """Signal the process group ``pid`` leads (its own session: see ``_spawn``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
