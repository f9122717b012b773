"""The Ray launcher (``streamrl run --launcher ray``): each stage is a Ray actor placed with the
resources its config asks for (``num_gpus`` for rollout, a reward model, the learner). The actor
runs the stage's usual command (``python -m streamrl VERB ...``) as its child, so a stage behaves
the same under Ray, under compose and by hand, and gets SIGTERM (a clean drain and commit) when
it is stopped. Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor; the child inherits it.

``ray`` is the ``[ray]`` extra, imported here only.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from streamrl.broker import stop_process
from streamrl.config import RestartConfig
from streamrl.launching import Launcher, _die_with_parent, stage_command


class _StageProcess:
    """The body of the stage actor: one stage process and its log."""

    def __init__(self, argv: list[str], log_path: str):
        self.log_path = log_path
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(stage_command(argv), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def returncode(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        stop_process(self.proc, timeout_s)
        return self.proc.returncode


class RayLauncher(Launcher):
    """Stages as Ray actors. The supervision is ``Launcher``'s (a crashed stage process is started
    again in a new actor); an actor lost with its node is restarted by Ray itself
    (``max_restarts``), which re-runs the stage."""

    def __init__(self, log_dir: Path, address: str = "", num_cpus: int = 0,
                 resources: dict[str, dict[str, float]] | None = None,
                 restart: RestartConfig | None = None, stop_timeout_s: float = 90.0):
        from streamrl.errors import need

        super().__init__(restart, stop_timeout_s)
        ray = need("ray", "ray", "streamrl run --launcher ray")
        self._ray = ray
        if not ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": num_cpus or None}
            ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
        self._actor_cls = ray.remote(_StageProcess)
        self.log_dir = log_dir
        self.resources = resources or {}
        self.actors: dict[str, object] = {}
        self._exited: dict[str, int | None] = {}
        self._generation: dict[str, int] = {}

    def _spawn(self, name: str, argv: list[str], kind: str) -> None:
        old = self.actors.get(name)
        if old is not None:
            self._ray.kill(old)
        self._exited.pop(name, None)
        generation = self._generation[name] = self._generation.get(name, -1) + 1
        options = {"num_cpus": 1, "num_gpus": 0, "max_restarts": self.policy.max_restarts,
                   **self.resources.get(kind, {})}
        self.actors[name] = self._actor_cls.options(
            name=f"streamrl-{name}-{os.getpid()}-{generation}", **options).remote(
            argv, str(self.log_dir / f"{name}.log"))

    def _poll(self, name: str) -> int | None:
        if name in self._exited:
            return self._exited[name]
        try:
            return self._ray.get(self.actors[name].returncode.remote(), timeout=30)
        except self._ray.exceptions.RayActorError:  # the actor itself is gone for good
            return -1

    def _stop(self, name: str, timeout_s: float) -> None:
        if name in self._exited:
            return
        actor = self.actors[name]
        self._exited[name] = self._ray.get(actor.stop.remote(timeout_s), timeout=timeout_s + 30)
        self._ray.kill(actor)

    def _stop_all(self, timeout_s: float) -> None:
        live = {n: a for n, a in self.actors.items() if n not in self._exited}
        codes = self._ray.get([a.stop.remote(timeout_s) for a in live.values()], timeout=timeout_s + 30)
        for (name, actor), code in zip(live.items(), codes):
            self._exited[name] = code
            self._ray.kill(actor)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
