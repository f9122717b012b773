"""One program, run where policy-written code belongs: isolated, limited, and forgotten after.

A policy under RL writes whatever maximises its reward: code that loops, forks without end, fills
memory or disk, reads the environment and files, opens sockets, kills its parent. ``Executor``
runs one program with its stdin under bubblewrap (Debian's ``bubblewrap``, the tool Flatpak
runs its apps in), chosen by measurement (docs/guides/sandbox.md):

- namespaces: user (the code holds no capability outside), pid (it sees and signals only its own
  processes; they all die with it), network (a loopback of its own, no route out), ipc, uts, mount:
  its filesystem is ``/usr`` (the language runtimes) read-only, a minimal ``/dev``, its own
  ``/proc``, the program read-only under ``/sandbox``, and a size-capped tmpfs scratch ``/tmp``
  (its working directory) and ``/dev/shm``, each ``scratch_mb``; everything else read-only
  (``/`` and ``/dev`` too: ``bwrap_argv``). Nothing of the host's ``/etc``, home directories or
  working trees;
- rlimits: CPU seconds, address space (``memory_limit_MB``), processes, file size, open files;
  the process count is per execution slot: a service started as root runs each slot under its
  own uid (``uid_base + slot``), so one execution's fork bomb cannot starve the others;
- a wall-clock deadline (the whole process group and pid namespace killed at it), and stdout /
  stderr capped in bytes (a 100 MB print is stopped at the cap);
- an empty environment (``PATH``, ``HOME=/tmp``, ``LANG`` only), bubblewrap's own included (its
  pid-1 reaper is visible inside at ``/proc/1/environ``): no secret of the service's.

``probe()`` measures which of these work here; the service and the local code scorer refuse to
run untrusted code below ``MINIMUM`` unless the user opts out by name (``--allow-unisolated``).
Level ``none`` (the opt-out, and the bench's baseline) is a bare subprocess with the rlimits and
the clean environment only.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from streamrl.errors import StreamrlError

#: the isolation the docs call the minimum for untrusted code: every layer of ``LAYERS`` working
MINIMUM = "namespaces"
LEVELS = ("namespaces", "none")
#: the layers ``probe`` measures, each needed by level ``namespaces``
LAYERS = ("bubblewrap", "user_ns", "pid_ns", "net_ns", "mount_ns", "scratch_size", "rlimits")

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
#: a started-as-root service runs slot i as uid/gid uid_base + i. Processes are counted per uid, so
#: two services (or a service and a reward member's local executor) on one host each take their own
#: range: ``streamrl sandbox --uid-base``
UID_BASE = 61000


@dataclass(frozen=True)
class Limits:
    """One execution's limits. ``cpu_s`` 0: the wall time rounded up, plus one second."""

    wall_s: float = 10.0
    cpu_s: float = 0.0
    memory_mb: int = 1024  # address space (RLIMIT_AS); verl's memory_limit_mb
    processes: int = 64  # processes and threads of the slot's uid (RLIMIT_NPROC)
    output_bytes: int = 8 << 20  # stdout and stderr, each
    scratch_mb: int = 64  # the tmpfs at /tmp
    file_mb: int = 32  # one file (RLIMIT_FSIZE)
    open_files: int = 256

    def cpu_seconds(self) -> int:
        return int(self.cpu_s) if self.cpu_s > 0 else math.ceil(self.wall_s) + 1


@dataclass
class RunResult:
    """SandboxFusion's ``CommandRunResult`` plus what stopped the program (``limit``: wall, cpu,
    output; empty when it ended by itself)."""

    status: str  # Finished | TimeLimitExceeded | Error (the sandbox's own failure, never the code's)
    return_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    execution_time: float = 0.0
    limit: str = ""

    def api(self) -> dict[str, Any]:
        return {"status": self.status, "execution_time": self.execution_time,
                "return_code": self.return_code, "stdout": self.stdout, "stderr": self.stderr}


@dataclass(frozen=True)
class Isolation:
    """What ``probe`` measured: the level reached, the tool, each layer (works or not), and the
    layers measured but not used (``cgroups``, ``seccomp``: docs/guides/sandbox.md says why)."""

    level: str
    tool: str = ""
    layers: dict[str, bool] = field(default_factory=dict)
    slot_uids: bool = False
    problems: tuple[str, ...] = ()
    unused: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        works = ", ".join(k for k, v in self.layers.items() if v) or "none"
        missing = [k for k, v in self.layers.items() if not v]
        text = f"isolation {self.level} ({self.tool or 'no tool'}): {works}"
        if self.slot_uids:
            text += ", one uid per slot"
        if missing:
            text += f"; missing: {', '.join(missing)}"
        return text


@dataclass(frozen=True)
class Runtime:
    """A language: the file its code goes in and the command that runs it (inside the sandbox)."""

    language: str
    filename: str
    argv: tuple[str, ...]


def runtimes(python: str = "") -> dict[str, Runtime]:
    """The languages whose runtime is installed under /usr (the sandbox sees /usr only).
    ``python``: the interpreter (default /usr/bin/python3)."""
    py = python or ("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "")
    found = {}
    if py:
        found["python"] = Runtime("python", "main.py", (py, "/sandbox/main.py"))
    if os.path.exists("/usr/bin/bash"):
        found["bash"] = Runtime("bash", "main.sh", ("/usr/bin/bash", "/sandbox/main.sh"))
    if os.path.exists("/usr/bin/node"):
        found["nodejs"] = Runtime("nodejs", "main.js", ("/usr/bin/node", "/sandbox/main.js"))
    return found


def _mounts() -> list[str]:
    """The read-only runtime: /usr, and the merged-/usr links (or binds) of /bin, /lib, ..."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = f"/{top}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_argv(limits: Limits, mounts: tuple[str, ...] = ()) -> list[str]:
    """bubblewrap's command line up to the program (each flag is a layer of the module doc);
    ``mounts``: more mount options (the program's file), made before the tree is made read-only.

    bubblewrap's own root and ``/dev`` are tmpfs mounts without a size: left writable, code could
    fill the host's memory through ``/``, ``/sandbox`` or ``/dev/shm`` past the capped scratch. So
    ``/dev/shm`` gets a capped tmpfs of its own and ``/`` and ``/dev`` are remounted read-only last
    (the device nodes and ``/dev/pts`` are mounts of their own and keep working)."""
    scratch = str(limits.scratch_mb << 20)
    return ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", *_mounts(), "--proc", "/proc", "--dev", "/dev",
            "--size", scratch, "--tmpfs", "/tmp", "--size", scratch, "--tmpfs", "/dev/shm", *mounts,
            "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
            "--clearenv", "--setenv", "PATH", SAFE_PATH, "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]


def _set_limits(limits: Limits) -> None:
    """In the child, before bubblewrap: inherited by everything the code starts."""
    cpu = limits.cpu_seconds()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    if limits.memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def probe(python: str = "") -> Isolation:
    """Measure, by running them, which layers work on this machine (a container may forbid user
    namespaces: then bubblewrap cannot start and the level is ``none``)."""
    layers = {k: False for k in LAYERS}
    unused = {"cgroups": "not used: the per-slot uid bounds processes and RLIMIT_AS memory without "
                         "a delegated cgroup tree (docs/guides/sandbox.md)",
              "seccomp": "not used: the network namespace has no route out and the user namespace "
                         "no capability; no seccomp compiler ships in the venv"}
    problems: list[str] = []
    tool = ""
    layers["rlimits"] = True  # setrlimit needs no privilege to lower
    slot_uids = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    if not bwrap:
        problems.append("bubblewrap is not installed (Debian: apt-get install bubblewrap)")
        return Isolation("none", "", layers, False, tuple(problems), unused)
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    tool = version or "bubblewrap"
    layers["bubblewrap"] = True
    py = runtimes(python).get("python")
    check = ("import os, socket, sys\n"
             "out = {'pid1': os.getpid() <= 3, 'ro': False, 'net': False, 'root': not os.path.exists('/etc')}\n"
             "out['ro'] = True\n"
             "for d in ('/usr', '/', '/dev', '/sandbox'):\n"
             "    try:\n        open(d + '/streamrl-probe', 'w')\n        out['ro'] = False\n    except OSError:\n        pass\n"
             "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\nexcept OSError:\n    out['net'] = True\n"
             "try:\n    open('/tmp/fill', 'wb').write(b'0' * (3 << 20))\n    out['size'] = False\n"
             "except OSError:\n    out['size'] = True\n"
             "print(repr(out))\n")
    if py is None:
        problems.append("no Python under /usr to probe with")
        return Isolation("none", tool, layers, False, tuple(problems), unused)
    limits = Limits(wall_s=10, scratch_mb=2)
    try:
        done = subprocess.run([*bwrap_argv(limits), py.argv[0], "-c", check], capture_output=True, text=True,
                              env={"PATH": SAFE_PATH},
                              timeout=30, preexec_fn=lambda: _set_limits(limits), **_slot_ids(0, slot_uids))
    except (OSError, subprocess.TimeoutExpired) as exc:
        problems.append(f"bubblewrap did not run: {exc}")
        return Isolation("none", tool, layers, False, tuple(problems), unused)
    if done.returncode != 0:
        problems.append(f"bubblewrap failed (user namespaces forbidden here?): {done.stderr.strip()[-300:]}")
        return Isolation("none", tool, layers, False, tuple(problems), unused)
    try:
        seen = {k: v is True for k, v in _parse_flags(done.stdout).items()}
    except ValueError:
        problems.append(f"the probe printed {done.stdout[-200:]!r}")
        return Isolation("none", tool, layers, False, tuple(problems), unused)
    layers.update(user_ns=True, pid_ns=seen.get("pid1", False), net_ns=seen.get("net", False),
                  mount_ns=seen.get("ro", False) and seen.get("root", False), scratch_size=seen.get("size", False))
    level = "namespaces" if all(layers.values()) else "none"
    problems += [f"layer {k} does not hold" for k, v in layers.items() if not v]
    return Isolation(level, tool, layers, slot_uids, tuple(problems), unused)


def _parse_flags(text: str) -> dict[str, Any]:
    """The probe's one line ``{'name': True, ...}``, read without eval."""
    line = text.strip().splitlines()[-1].strip()
    if not (line.startswith("{") and line.endswith("}")):
        raise ValueError(line)
    out: dict[str, Any] = {}
    for part in line[1:-1].split(","):
        key, _, value = part.partition(":")
        out[key.strip().strip("'")] = value.strip() == "True"
    return out


def _slot_ids(slot: int, slot_uids: bool, base: int = UID_BASE) -> dict[str, Any]:
    if not slot_uids:
        return {}
    uid = base + slot
    return {"user": uid, "group": uid, "extra_groups": []}


#: the pauses before bubblewrap's start is tried again in the same slot (``Executor._not_started``)
START_RETRY_S = (0.05, 0.1, 0.2, 0.4, 0.8)


class Executor:
    """Runs programs, at most ``slots`` at once (the others wait for a slot), each isolated as
    ``isolation.level`` says. ``level`` ``none`` is refused for untrusted code unless
    ``allow_unisolated``: the caller names the opt-out."""

    def __init__(self, isolation: Isolation, *, slots: int = 4, python: str = "",
                 allow_unisolated: bool = False, uid_base: int = UID_BASE):
        if isolation.level != MINIMUM and not allow_unisolated:
            raise IsolationError(
                f"{isolation.describe()}: below the minimum ({MINIMUM}: {', '.join(LAYERS)}); "
                f"{'; '.join(isolation.problems)}. Install bubblewrap where user namespaces are "
                f"allowed, or opt out by name with --allow-unisolated (sandbox.allow_unisolated)")
        self.isolation = isolation
        self.runtimes = runtimes(python)
        self.slots: asyncio.Queue[int] | None = None
        self.n_slots = slots
        self.uid_base = uid_base
        self.waiting = 0

    def languages(self) -> list[str]:
        return sorted(self.runtimes)

    async def run(self, language: str, code: str, stdin: str | None, limits: Limits) -> RunResult:
        """Run ``code`` with ``stdin`` and return what it did. The code's own failures (crash,
        limit) are a ``Finished`` / ``TimeLimitExceeded`` result; ``Error`` only when the
        sandbox itself could not run it."""
        runtime = self.runtimes.get(language)
        if runtime is None:
            return RunResult("Error", stderr=f"language {language!r} is not installed here "
                                             f"(this sandbox runs {self.languages()})")
        if self.slots is None:
            self.slots = asyncio.Queue()
            for i in range(self.n_slots):
                self.slots.put_nowait(i)
        self.waiting += 1
        try:
            slot = await self.slots.get()
        finally:
            self.waiting -= 1
        try:
            for pause in (0.0, *START_RETRY_S):
                await asyncio.sleep(pause)
                result = await self._run(runtime, code, stdin, limits, slot)
                if not self._not_started(result):
                    return result
            # the program's own outcome as the sandbox saw it (a failed run), never ``Error``: the
            # scorer holds a record on ``Error`` until the sandbox serves it, and a program that
            # prints bubblewrap's error on every run would hold its partition for good
            result.stderr += f"\nstreamrl sandbox: bubblewrap refused the start {len(START_RETRY_S) + 1} times"
            return result
        finally:
            self.slots.put_nowait(slot)

    def _not_started(self, result: RunResult) -> bool:
        """bubblewrap failed before the program ran: exit 1, nothing on stdout, its own error on
        stderr. Its fork of the namespace's first process fails with EAGAIN when the slot's uid is
        at ``processes``, and the kernel releases an exited process's count some time after it
        was reaped: one slot running ~10 short programs in a row held 32 (measured: 181 of 200
        runs refused at ``--processes 32``, 0 with this retry). A program that prints such a line
        and exits 1 only earns itself the retries and then its failed run: never a pass."""
        return (self.isolation.level == MINIMUM and result.status == "Finished" and result.return_code == 1
                and not result.stdout and result.stderr.startswith("bwrap: ") and not result.limit)

    async def _run(self, runtime: Runtime, code: str, stdin: str | None, limits: Limits,
                   slot: int) -> RunResult:
        scratch = None
        pass_fds: tuple[int, ...] = ()
        if self.isolation.level == MINIMUM:
            fd = os.memfd_create(runtime.filename)
            os.write(fd, code.encode())
            os.lseek(fd, 0, os.SEEK_SET)
            pass_fds = (fd,)
            argv = [*bwrap_argv(limits, ("--ro-bind-data", str(fd), f"/sandbox/{runtime.filename}")), *runtime.argv]
            # bubblewrap itself gets nothing of ours either: its pid-1 reaper, inside the namespace,
            # keeps the environment it started with (readable at /proc/1/environ)
            env = {"PATH": SAFE_PATH}
            cwd = None
            ids = _slot_ids(slot, self.isolation.slot_uids, self.uid_base)
        else:  # the opt-out / the bench's baseline: a bare subprocess, rlimits and clean env only
            scratch = tempfile.mkdtemp(prefix="streamrl-sandbox-")
            path = os.path.join(scratch, runtime.filename)
            with open(path, "w") as f:
                f.write(code)
            argv = [*runtime.argv[:-1], path]
            env = {"PATH": SAFE_PATH, "HOME": scratch, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
            cwd = scratch
            ids = {}
        start = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, pass_fds=pass_fds, env=env, cwd=cwd,
                preexec_fn=lambda: _set_limits(limits), **ids)
        except OSError as exc:
            return RunResult("Error", stderr=f"the sandbox could not start: {exc}")
        finally:
            for fd in pass_fds:
                os.close(fd)
        try:
            return await self._collect(proc, stdin, limits, start)
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)

    async def _collect(self, proc: asyncio.subprocess.Process, stdin: str | None, limits: Limits,
                       start: float) -> RunResult:
        over: list[str] = []

        def kill(why: str) -> None:
            if why and why not in over:
                over.append(why)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        async def feed() -> None:
            assert proc.stdin is not None
            try:
                if stdin:
                    proc.stdin.write(stdin.encode())
                    await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        async def read(stream: asyncio.StreamReader) -> bytes:
            chunks, size = [], 0
            while True:
                chunk = await stream.read(1 << 16)
                if not chunk:
                    return b"".join(chunks)
                if size + len(chunk) > limits.output_bytes:
                    chunks.append(chunk[:limits.output_bytes - size])
                    kill("output")
                    # drained to its end (the program is dead: a few buffers): asyncio finishes a
                    # process only when every pipe of it has closed, and a full reader stops reading
                    while await stream.read(1 << 16):
                        pass
                    return b"".join(chunks)
                chunks.append(chunk)
                size += len(chunk)

        assert proc.stdout is not None and proc.stderr is not None
        work = asyncio.gather(feed(), read(proc.stdout), read(proc.stderr), proc.wait())
        try:
            _, out, err, rc = await asyncio.wait_for(asyncio.shield(work), limits.wall_s)
        except asyncio.TimeoutError:
            kill("wall")
            try:  # a process that escaped the group (level none only) may hold the pipes: bounded
                _, out, err, rc = await asyncio.wait_for(work, 10)
            except asyncio.TimeoutError:
                out, err, rc = b"", b"", -signal.SIGKILL
        except asyncio.CancelledError:
            kill("")
            await asyncio.gather(work, return_exceptions=True)
            raise
        elapsed = time.perf_counter() - start
        if self.isolation.level == MINIMUM and rc is not None and rc > 128:
            rc = -(rc - 128)  # bubblewrap exits 128 + the signal that killed the program
        if rc in (-signal.SIGXCPU,) and "cpu" not in over:
            over.append("cpu")
        stderr = err.decode(errors="replace")
        if over:
            stderr += f"\nstreamrl sandbox: stopped at the {over[0]} limit"
        status = "TimeLimitExceeded" if over and over[0] in ("wall", "cpu") else "Finished"
        if over and over[0] == "output" and rc == 0:
            rc = -signal.SIGKILL
        return RunResult(status, rc, out.decode(errors="replace"), stderr, round(elapsed, 6),
                         over[0] if over else "")


class IsolationError(StreamrlError):
    """The isolation measured here is below the minimum and no opt-out was given."""
