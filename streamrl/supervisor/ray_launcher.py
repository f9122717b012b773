"""The Ray launcher (``streamrl run --launcher ray``): each stage is a Ray actor placed with the
resources its config asks for (``run.ray.resources``: CPUs, GPUs, memory, custom resources). The
actor runs the stage's usual command (``python -m streamrl VERB ...``) as its child, so a stage
behaves the same under Ray, under compose and by hand, and gets SIGTERM (a clean drain and
commit) when it is stopped. Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor; the child inherits it.

Across nodes (``RayLauncher.for_run`` checks all of this before any stage starts):

- the broker must be reachable from every node: the embedded one listens on this machine's
  loopback, so a cluster of more than one node needs ``--bootstrap-servers``;
- every stage must fit: each against the largest node, and all of them together, placed in the
  order ``streamrl run`` starts them; a stage that cannot is named with its config field;
- environment variables named in ``run.ray.env_vars`` reach each stage's process, their values
  passed as an argument of its actor (not in Ray's ``runtime_env``: Ray's runtime-env agent
  writes a runtime_env's ``env_vars`` to its log in plain text);
- the config file is shipped to nodes that do not have it; the run's directories are absolute;
  ``run.ray.working_dir`` is uploaded by Ray (a source checkout, scorer files) and the stages
  run in it; weights reach other nodes through ``learner.weights_uri`` (``streamrl.weights``)
  or a filesystem every node mounts at the same path.

What may go where is worked out first, without Ray, in ``streamrl.supervisor.placement``; this module
is the Ray runtime: the actors, placement groups, supervision. ``ray`` is the ``[ray]`` extra,
imported here only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from streamrl.broker import die_with_parent as _die_with_parent
from streamrl.broker import stop_process
from streamrl.config import RestartConfig
from streamrl.errors import ConfigError, StreamrlError
from streamrl.supervisor.launcher import Launcher, StageLost, _metrics_url, stage_command
from streamrl.supervisor.placement import (DEFAULT_RESOURCES, EPS, STAGES, actor_options, check_placement, demand_of,
                                     describe, stage_counts, stage_env, stage_resources)

log = logging.getLogger(__name__)

#: left out of ``run.ray.working_dir``'s upload (Ray also honours its .gitignore)
WORKING_DIR_EXCLUDES = [".git/", ".venv/", "venv/", "runs/", "build/", "dist/", "*.egg-info/", "__pycache__/"]


# -- the actor ------------------------------------------------------------------------------------
class _StageProcess:
    """The body of the stage actor: one stage process and its log (on the actor's node)."""

    def __init__(self, argv: list[str], log_path: str, env: dict[str, str] | None = None,
                 cwd: str | None = None, files: dict[str, str] | None = None):
        import ray

        self.log_path = log_path
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        argv = _localise(argv, files or {}, Path(log_path).parent)
        run_in = cwd if cwd and os.path.isdir(cwd) else os.getcwd()
        with open(log_path, "ab") as out:
            self.log_from = out.tell()  # this process's output begins here (a restart appends)
            out.write(f"[ray] node {self.node_id} ({self.node_ip}), in {run_in}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(stage_command(argv), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, cwd=run_in,
                                         env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})

    def ready(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "node_ip": self.node_ip, "pid": self.proc.pid}

    def returncode(self) -> int | None:
        return self.proc.poll()

    def metrics_url(self) -> str | None:
        """The ``metrics: URL`` line this actor's process printed, if it has."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self.log_from)
                return _metrics_url(log_file.read().decode(errors="replace"))
        except OSError:
            return None

    def stop(self, timeout_s: float) -> tuple[int | None, str]:
        stop_process(self.proc, timeout_s)
        return self.proc.returncode, self.tail(40)

    def tail(self, lines: int = 20) -> str:
        path = Path(self.log_path)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _localise(argv: list[str], files: dict[str, str], into: Path) -> list[str]:
    """``--config PATH`` where PATH is not on this node: a copy of the driver's file, written
    into ``into`` (the run's log directory on this node, beside the stage's log: the run's own
    files, never a stray copy in the temp directory)."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):
        path = argv[i + 1]
        if arg == "--config" and path in files and not os.path.exists(path):
            text = files[path]
            local = into / f"config-{hashlib.sha256(text.encode()).hexdigest()[:16]}-{Path(path).name}"
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text)
            argv[i + 1] = str(local)
    return argv


# -- the launcher ---------------------------------------------------------------------------------
class RayLauncher(Launcher):
    """Stages as Ray actors. The supervision is ``Launcher``'s (a crashed stage process is started
    again in a new actor); an actor lost with its node is restarted by Ray itself
    (``max_restarts``, not for the feed), which re-runs the stage.

    Nothing here waits on Ray: each supervision sends every running actor a status call and
    collects the answers that came (``ray.wait`` with no timeout), so a frozen node (its actors
    answer nothing, and Ray marks it dead only a minute later) or a slow control plane holds no
    one. An actor silent for ``run.stage_timeout_s`` is its stage gone: the actor is ended
    (off this thread) and the stage restarted where Ray finds room; its consumer group's
    members take its partitions meanwhile (the broker drops it at its session timeout)."""

    def __init__(self, log_dir: Path, address: str = "", num_cpus: int = 0,
                 resources: dict[str, dict[str, float]] | None = None,
                 restart: RestartConfig | None = None, stop_timeout_s: float = 90.0,
                 env: dict[str, str] | None = None, working_dir: str = "",
                 placement_timeout_s: float = 120.0, cwd: str | None = None, learner_ranks: int = 1,
                 stage_timeout_s: float = 30.0):
        from streamrl.errors import need

        super().__init__(restart, stop_timeout_s, stage_timeout_s)
        ray = need("ray", "ray", "streamrl run --launcher ray")
        self._ray = ray
        self.connected = False  # this launcher connected to Ray (close() disconnects)
        # run.ray.working_dir is a job-level runtime_env: Ray uploads it once, at connection,
        # and every actor of this driver runs in its copy
        runtime_env = {"working_dir": working_dir, "excludes": WORKING_DIR_EXCLUDES} if working_dir else None
        if not ray.is_initialized():
            # no address: a Ray of this run's own ("local"), never a cluster that happens to be
            # running on this machine (ray.init() alone would join one started by `ray start`)
            kwargs = {"address": address} if address else {"address": "local", "num_cpus": num_cpus or None}
            try:
                ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                         runtime_env=runtime_env, **kwargs)
            except (ConnectionError, RuntimeError, ValueError, OSError) as exc:
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                fields = "run.ray.address" + (", run.ray.working_dir" if working_dir else "")
                what = f"join the Ray cluster at {address!r}" if address else "start a local Ray"
                raise StreamrlError(f"cannot {what} ({fields}): {why}") from None
            self.connected = True
        elif working_dir and not (ray.get_runtime_context().runtime_env or {}).get("working_dir"):
            raise StreamrlError("run.ray.working_dir: Ray is already initialized in this process without it "
                                "(pass runtime_env={'working_dir': ...} to ray.init, or let the launcher connect)")
        self._actor_cls = ray.remote(_StageProcess)
        self.log_dir = log_dir
        self.resources = {**DEFAULT_RESOURCES, **(resources or {})}  # stage -> ask (config keys)
        self.placement_timeout_s = placement_timeout_s
        self._env = dict(env or {})
        self._cwd = None if working_dir else (cwd or os.getcwd())  # with working_dir: Ray's copy of it
        self._files: dict[str, str] = {}  # config files, shipped to nodes that lack them
        self.actors: dict[str, Any] = {}
        self.notes: list[str] = []  # lines for the user, from for_run
        self._exited: dict[str, int | None] = {}
        self._generation: dict[str, int] = {}
        self._pending: dict[str, tuple[Any, float]] = {}  # not placed (or not started) yet
        self._where: dict[str, dict[str, Any]] = {}  # name -> node id, ip, pid
        self._tails: dict[str, str] = {}  # a stopped stage's log tail (its node may be another)
        self._codes: dict[str, int | None] = {}  # the last status each actor answered
        self._probes: dict[str, Any] = {}  # name -> its status call in flight
        self._url_probes: dict[str, Any] = {}  # name -> its metrics_url call in flight
        # learner.parallel.nproc > 1: one placement group, a bundle per rank (run.ray.resources.learner
        # each), all on one node as torch's launcher starts the ranks there; the actor runs in bundle 0
        self.learner_ranks = learner_ranks
        self._groups: dict[str, Any] = {}

    # -- ``streamrl run``: connect, check, then start --------------------------------------------
    @classmethod
    def for_run(cls, cfg: Any, log_dir: Path, embedded_broker: bool) -> "RayLauncher":
        """Connect to Ray (or start a local one) for ``streamrl run`` and check, before any stage
        starts, that this run can work there: the broker reachable from every node, every stage
        placeable, every named variable set. Each failure is one ``StreamrlError`` line."""
        ray_cfg = cfg.run.ray
        asks = stage_resources(cfg)
        counts = stage_counts(cfg)
        env = stage_env(cfg)
        working_dir = ""
        if ray_cfg.working_dir:
            working_dir = str(Path(ray_cfg.working_dir).expanduser().resolve())
            if not Path(working_dir).is_dir():
                raise ConfigError(f"config field 'run.ray.working_dir': {ray_cfg.working_dir!r} is not a directory")
        if not ray_cfg.placement_timeout_s > 0:
            raise ConfigError("config field 'run.ray.placement_timeout_s': must be > 0")
        notes = []
        num_cpus = ray_cfg.num_cpus
        if not ray_cfg.address and not num_cpus:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            wanted = sum(asks[kind].get("num_cpus", 0.0) * counts[kind] for kind in STAGES)
            num_cpus = max(cores, math.ceil(wanted - EPS))
            if num_cpus > cores:
                notes.append(f"ray: a local Ray with {num_cpus} logical CPUs for the stages' {wanted:g} "
                             f"(this machine has {cores} cores, which they share; run.ray.num_cpus sets it)")
        launcher = cls(log_dir, address=ray_cfg.address, num_cpus=num_cpus, resources=asks,
                       restart=cfg.run.restart, stop_timeout_s=cfg.run.stop_timeout_s, env=env,
                       working_dir=working_dir, placement_timeout_s=ray_cfg.placement_timeout_s,
                       learner_ranks=cfg.learner.parallel.nproc, stage_timeout_s=cfg.run.stage_timeout_s)
        try:
            launcher._check_cluster(cfg, asks, counts, embedded_broker, notes)
        except BaseException:
            launcher.close()
            raise
        launcher.notes = notes
        return launcher

    def _check_cluster(self, cfg: Any, asks: dict[str, dict[str, float]], counts: dict[str, int],
                       embedded_broker: bool, notes: list[str]) -> None:
        ray = self._ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        address = cfg.run.ray.address
        here = ray.util.get_node_ip_address()
        hosts = sorted({n.get("NodeManagerAddress", "") for n in nodes})
        client_host = address[len("ray://"):].rsplit(":", 1)[0] if address.startswith("ray://") else ""
        remote_client = bool(client_host) and client_host not in ("127.0.0.1", "localhost", "::1", here)
        other_hosts = [h for h in hosts if h != here] if not remote_client else hosts
        where = f"the Ray cluster at {address!r}" if address else "the local Ray"
        if embedded_broker and (len(nodes) > 1 or other_hosts or remote_client):
            raise StreamrlError(
                f"{where} has {len(nodes)} node{'s' * (len(nodes) != 1)}, and the embedded broker listens on this "
                f"machine's loopback only: give a Kafka every node reaches with --bootstrap-servers HOST:PORT "
                f"(or STREAMRL_BOOTSTRAP_SERVERS)")
        servers = [s.strip() for s in cfg.bus.bootstrap_servers.split(",") if s.strip()]
        loopback = [s for s in servers if s.rsplit(":", 1)[0].strip("[]") in ("127.0.0.1", "localhost", "::1")]
        if not embedded_broker and other_hosts and loopback:
            raise StreamrlError(
                f"--bootstrap-servers {','.join(loopback)} is a loopback address, and {where} has nodes on other "
                f"hosts ({', '.join(other_hosts)}): give the broker's address every node reaches")
        if cfg.run.ray.check_placement:
            problem = check_placement(asks, counts, [n.get("Resources", {}) for n in nodes],
                                      scaled_from=cfg.run.reward_members if cfg.run.autoscale.max_members else None)
            if problem:
                raise StreamrlError(problem + ("" if address else "; on one machine, run.ray.num_cpus adds logical CPUs"
                                               if "CPU" in problem else ""))
        if len(nodes) > 1 and not cfg.learner.weights_uri:
            notes.append(f"ray: {len(nodes)} nodes: rollout workers on other nodes than the learner's read the weights "
                         f"at {self.log_dir.parent / 'weights'}, so that must be a filesystem they share; or set "
                         f"learner.weights_uri (s3://..., gs://...)")

    def close(self) -> None:
        """Disconnect from Ray if this launcher connected: a local Ray it started ends with it, a
        cluster it joined keeps running."""
        for group in self._groups.values():
            try:
                self._ray.util.remove_placement_group(group)
            except Exception:  # Ray already gone
                pass
        self._groups.clear()
        if self.connected:
            self._ray.shutdown()
            self.connected = False

    # -- Launcher -----------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], kind: str) -> None:
        old = self.actors.get(name)
        if old is not None:
            self._end(old)
        for state in (self._exited, self._where, self._codes, self._probes, self._url_probes):
            state.pop(name, None)
        generation = self._generation[name] = self._generation.get(name, -1) + 1
        options = {**actor_options(self.resources.get(kind, {})),
                   "max_restarts": 0 if kind == "feed" else self.policy.max_restarts}  # a feed re-run publishes twice
        if kind == "learner" and self.learner_ranks > 1:
            options["scheduling_strategy"] = self._rank_group(name, self.resources.get(kind, {}))
        try:
            actor = self._actor_cls.options(name=f"streamrl-{name}-{os.getpid()}-{generation}", **options).remote(
                argv, str(self.log_dir / f"{name}.log"), self._env, self._cwd, self._files_for(argv))
        except Exception as exc:  # e.g. the working_dir upload refused
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StageLost(f"stage {name!r}: Ray cannot start its actor: {why}") from None
        self.actors[name] = actor
        self._pending[name] = (actor.ready.remote(), time.monotonic())

    def _rank_group(self, name: str, ask: dict[str, float]) -> Any:
        """The learner's placement group (made once, kept across its restarts): a bundle per rank
        on one node (STRICT_PACK), the actor in bundle 0."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if name not in self._groups:
            bundle = {r: a for r, (a, _) in demand_of(ask).items()}
            self._groups[name] = self._ray.util.placement_group([dict(bundle) for _ in range(self.learner_ranks)],
                                                                strategy="STRICT_PACK", name=f"streamrl-{name}-{os.getpid()}")
        return PlacementGroupSchedulingStrategy(self._groups[name], placement_group_bundle_index=0)

    def placement_group(self, name: str = "learner") -> Any:
        return self._groups.get(name)

    def _files_for(self, argv: list[str]) -> dict[str, str]:
        for arg, path in zip(argv, argv[1:]):
            if arg == "--config" and path not in self._files and os.path.isfile(path):
                self._files[path] = Path(path).read_text()
        return {p: t for p, t in self._files.items() if p in argv}

    def _end(self, actor: Any) -> None:
        """End an actor without waiting on Ray (its node may be frozen, Ray's control plane
        slow): in a thread of its own."""
        def end() -> None:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # already gone, or Ray is
                pass

        threading.Thread(target=end, name="streamrl-ray-kill", daemon=True).start()

    def _placed(self, name: str) -> bool:
        """Whether the stage's actor runs (its process started); raises ``StageLost``, naming
        the stage, once Ray has not placed it within ``placement_timeout_s``."""
        if name not in self._pending:
            return True
        ref, since = self._pending[name]
        done, _ = self._ray.wait([ref], timeout=0)
        if not done:
            waited = time.monotonic() - since
            if waited > self.placement_timeout_s:
                self._exited[name] = -1
                del self._pending[name]
                raise StageLost(self._not_placed(name, waited))
            return False
        del self._pending[name]
        try:
            self._where[name] = self._ray.get(ref, timeout=0)  # done: at once
        except self._ray.exceptions.RayError:  # it died starting: the status call says so
            self._where[name] = {}
        self.stages[name].answered_at = time.monotonic()
        return True

    def _not_placed(self, name: str, waited: float) -> str:
        kind = self.stages[name].kind if name in self.stages else name
        demand = demand_of(self.resources.get(kind, {}))
        try:
            free = self._ray.available_resources()
            free_now = ", ".join(describe(r, free.get(r, 0.0)) for r in demand) or "-"
        except Exception:
            free_now = "unknown"
        asks = ", ".join(describe(r, a) for r, (a, _) in demand.items()) or "nothing"
        return (f"stage {name!r} was not placed in {waited:.0f} s: it asks for {asks}; free in the cluster now: "
                f"{free_now} (other jobs may hold them; run.ray.resources.{kind}, run.ray.placement_timeout_s)")

    def _poll(self, name: str) -> int | None:
        """What the actor last answered (``_refresh`` asks it): never waits."""
        if name in self._exited:
            return self._exited[name]
        return self._codes.get(name)

    def _refresh(self, name: str) -> None:
        """Collect the actor's answer to its status call if it came, and send the next one: a
        stage is alive while its actor answers (``Launcher`` ends one silent for
        ``stage_timeout_s``). Never waits."""
        if name in self._exited or not self._placed(name):
            return
        ref = self._probes.get(name)
        if ref is not None:
            done, _ = self._ray.wait([ref], timeout=0)
            if not done:
                return
            del self._probes[name]
            try:
                self._codes[name] = self._ray.get(ref, timeout=0)
            except self._ray.exceptions.GetTimeoutError:
                return
            except self._ray.exceptions.RayError:  # the actor itself is gone (died, lost with its node)
                self._codes[name] = -1
            self.stages[name].answered_at = time.monotonic()
        if self._codes.get(name) is None:
            self._probes[name] = self.actors[name].returncode.remote()

    def _alive(self, name: str) -> bool | None:
        return None  # ``_refresh`` notes each answer as it comes

    def _placing(self, name: str) -> bool:
        return name in self._pending  # ``placement_timeout_s`` bounds that wait

    def _kill(self, name: str) -> None:
        self._exited[name] = -9
        self._probes.pop(name, None)
        self._end(self.actors[name])

    def _find_url(self, name: str) -> str | None:
        if name in self._exited or name in self._pending:
            return None
        ref = self._url_probes.get(name)
        if ref is None:
            self._url_probes[name] = self.actors[name].metrics_url.remote()
            return None
        done, _ = self._ray.wait([ref], timeout=0)
        if not done:
            return None
        del self._url_probes[name]
        try:
            return self._ray.get(ref, timeout=0)
        except Exception:  # the actor is gone, or busy: asked again next time
            return None

    def _stop(self, name: str, timeout_s: float) -> None:
        if name in self._exited:
            return
        self._stop_all_of([name], timeout_s)

    def _stop_all(self, timeout_s: float, names: list[str]) -> None:
        self._stop_all_of([n for n in names if n in self.actors and n not in self._exited], timeout_s)

    def _stop_all_of(self, names: list[str], timeout_s: float) -> None:
        """SIGTERM every named stage's process at once, wait for them (bounded), then end the
        actors; one that never got placed, or does not answer, is ended and named in the log."""
        refs = {}
        pending = [self._pending[n][0] for n in names if n in self._pending]
        if pending:  # one starting now gets its SIGTERM; one Ray cannot place is just ended
            self._ray.wait(pending, num_returns=len(pending), timeout=min(10.0, timeout_s))
        for name in names:
            try:
                placed = self._placed(name)
            except StreamrlError:
                placed = False
            if placed:
                refs[name] = self.actors[name].stop.remote(timeout_s)
            else:
                self._exited[name] = None
        if refs:
            self._ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s + 30)
        for name, ref in refs.items():
            try:
                code, self._tails[name] = self._ray.get(ref, timeout=0)
            except self._ray.exceptions.GetTimeoutError:
                log.warning("stage %s did not stop in %.0f s; ending its Ray actor", name, timeout_s + 30)
                code = None
            except self._ray.exceptions.RayActorError:
                code = -1
            self._exited[name] = code
        for name in names:
            try:
                self._ray.kill(self.actors[name])
            except Exception:  # already gone
                pass

    def log_tail(self, name: str, lines: int = 20) -> str:
        """From the stage's actor (its log is on the actor's node), else what it said when it
        stopped, else the file here."""
        actor = self.actors.get(name)
        if actor is not None and name not in self._exited and name not in self._pending:
            try:
                return self._ray.get(actor.tail.remote(lines), timeout=5)
            except Exception:  # its node is gone or frozen: what this machine has
                pass
        if name in self._tails:
            return "\n".join(self._tails[name].splitlines()[-lines:])
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
