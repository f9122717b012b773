"""The runtime: the one object a streamrl process runs in. It owns the connection to Kafka (the
``Bus``), the topics (created or checked at start), the metrics HTTP server, the signals
(SIGINT/SIGTERM: a graceful stop) and the supervision of the stage it runs (the broker watch);
a stage is something it runs (``Stage``). As in Quix Streams' ``Application`` and faust's
``App`` + ``Worker``, a stage never builds a client, serves metrics or installs a signal
handler itself: it is handed the bus and a stop event.

Every process starts this way: the stage verbs, ``services/*.py``, compose, Kubernetes and both
launchers of ``streamrl run`` go through ``serve_stage``; ``streamrl run``'s supervisor and
``streamrl topics`` use a ``Runtime`` without a stage.

A stage process ends with:

- 0: the stage's work ended (its data, ``learner.versions``) or a signal stopped it, drained;
- 1: the broker stayed unreachable for ``bus.unavailable_timeout_s`` (the stage is told to stop
  and gets 30 s to drain; with no broker it may never finish, so the process then exits hard);
- 2: a user error (``StreamrlError``: a bad config field, no broker configured or none
  answering at start), printed on one line by the caller (``streamrl.cli``, ``stage_main``).

Stall detection is not per stage: ``streamrl run`` sees the whole pipeline from its topics
(``streamrl.supervisor.watch``) and restarts or stops the stages (``streamrl.supervisor.launcher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Iterator, Protocol, TypeVar

from streamrl.broker import EmbeddedBroker, watch_broker
from streamrl.errors import StreamrlError
from streamrl.topics import ensure_topics, sized_specs

if TYPE_CHECKING:
    from streamrl.broker import EmbeddedBroker
    from streamrl.bus import Bus
    from streamrl.pipeline_config import PipelineConfig
    from streamrl.topics import TopicState

__all__ = ["Runtime", "Stage", "broker_for", "open_broker", "probe_bootstrap", "require_bootstrap",
           "run_until_signalled", "serve_metrics", "serve_stage"]

T = TypeVar("T")

NO_BROKER = ("no broker: pass --bootstrap-servers HOST:PORT or set STREAMRL_BOOTSTRAP_SERVERS "
             "(start one with `streamrl broker`)")

#: how long a stage told to stop because the broker is gone may take to drain before the
#: process exits hard (with no broker its commits may never return)
GONE_DRAIN_S = 30.0


class Stage(Protocol):
    """What every stage (feed, rollout, reward, learner, archive) offers the runtime."""

    name: ClassVar[str]

    @classmethod
    def from_config(cls, cfg: "PipelineConfig", bus: "Bus") -> "Stage":
        """Build it on the runtime's bus (load models, build the scorer table); connect nothing yet."""

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad field."""

    def describe(self) -> str:
        """One line for the start-up banner (and the stop line)."""

    async def run(self, stop: asyncio.Event) -> Any:
        """Work until done or ``stop`` is set; drain, commit, leave."""


class Runtime:
    """One process's connection, topics, metrics server, signals and stage supervision.

    ``Runtime(cfg, name)`` checks that a broker is configured (else a ``StreamrlError``, exit 2)
    and builds the bus, connecting nothing; ``run(main)`` runs ``main(runtime)`` on a new event
    loop with SIGINT/SIGTERM setting ``stop_event``; inside it, ``serve(stage_cls)`` runs a stage,
    or ``start()`` does the start-up alone (broker answers, topics, metrics). ``state`` says where
    it is: ``built``, ``starting``, ``running``, ``stopping``, ``stopped``."""

    def __init__(self, cfg: "PipelineConfig", name: str = "streamrl"):
        if not cfg.bus.bootstrap_servers:
            raise StreamrlError(NO_BROKER)
        from streamrl.bus import Bus
        from streamrl.bus.lag import ConsumerLag

        self.cfg, self.name = cfg, name
        self.bus = Bus(cfg.bus)
        self.bus.commit_observer = ConsumerLag  # every consuming stage's lag gauges
        self.stop_event = asyncio.Event()
        self.metrics_port: int | None = None
        self.state = "built"

    # -- the process ----------------------------------------------------------------------------

    def run(self, main: Callable[["Runtime"], Awaitable[T]]) -> T:
        """``main(self)`` on a new event loop; SIGINT/SIGTERM call ``stop()``."""
        return _run_with_signals(lambda: main(self), self.stop)

    def stop(self) -> None:
        """A graceful stop: the stage drains, commits and leaves."""
        self.stop_event.set()

    # -- start-up -------------------------------------------------------------------------------

    async def start(self, *, metrics: bool = True) -> None:
        """The broker answers (else a ``StreamrlError`` naming it), the topics exist as their
        specs say, and (``metrics``) the metrics server runs on the port it prints."""
        self.state = "starting"
        await asyncio.to_thread(probe_bootstrap, self.cfg.bus.bootstrap_servers)
        await self.topics()
        if metrics:
            self.serve_metrics()
        self.state = "running"

    async def topics(self, create: bool = True) -> list["TopicState"]:
        """The pipeline's topics on the broker: created where missing (``create``), each
        described with its drift from ``topics/*.json`` sized by ``topics.<name>.partitions``."""
        return await ensure_topics(self.bus, create=create, specs=sized_specs(self.cfg.topics))

    def serve_metrics(self) -> int:
        """Serve Prometheus metrics on ``metrics.port`` (0: a free one) and print where."""
        self.metrics_port = serve_metrics(self.cfg)
        return self.metrics_port

    # -- a stage --------------------------------------------------------------------------------

    async def serve(self, stage_cls: type[Stage]) -> int:
        """Run one stage: built on the bus and validated before anything connects (a bad config
        fails here, naming its field), then the start-up, then its work under the broker watch.
        Returns the exit status (module docstring)."""
        stage = stage_cls.from_config(self.cfg, self.bus)  # inside the loop: the Kafka client wants a running one
        stage.validate()
        await self.start()
        print(f"{stage_cls.name}: {stage.describe()}", flush=True)
        gone = await self.supervise(stage.run(self.stop_event))
        if gone is not None:
            return 1
        print(f"{stage_cls.name}: stopped, {stage.describe()}", flush=True)
        return 0

    async def supervise(self, work: Awaitable[Any]) -> str | None:
        """Await ``work`` while watching the broker: if it stays unreachable for
        ``bus.unavailable_timeout_s``, stop (``work`` drains), give it ``GONE_DRAIN_S``, and
        return the reason (the process exits hard if the drain does not end). None: ``work``
        ended by itself or by a stop. Reports name the runtime (``name``: the stage's)."""
        bus = self.cfg.bus
        watch = asyncio.create_task(watch_broker(bus.bootstrap_servers, bus.unavailable_timeout_s,
                                                 self.stop_event, self.name))
        task = asyncio.ensure_future(work)
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
        gone = watch.result() if watch.done() else None
        if gone:  # the stage was told to stop; with no broker its drain may never finish
            self.state = "stopping"
            print(f"{self.name}: {gone}: stopping", file=sys.stderr, flush=True)
            done, _ = await asyncio.wait([task], timeout=GONE_DRAIN_S)
            if not done:
                os._exit(1)
            self.state = "stopped"
            return gone
        watch.cancel()
        await task
        self.state = "stopped"
        return None


def serve_metrics(cfg: "PipelineConfig") -> int:
    """Serve Prometheus metrics on ``metrics.port`` (0: a free one) and ``metrics.host``, print
    where (the line every long-running verb prints at start), and return the port."""
    from streamrl import metrics

    m = cfg.metrics
    port = metrics.serve(m.port, m.host)
    print(f"metrics: http://{m.host}:{port}/metrics", flush=True)
    return port


def serve_stage(stage_cls: type[Stage], cfg: "PipelineConfig") -> int:
    """Run one stage as this process (``Runtime.serve``) and return its exit status."""
    return Runtime(cfg, stage_cls.name).run(lambda runtime: runtime.serve(stage_cls))


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run ``main(stop_event)`` on a new event loop; SIGINT/SIGTERM set the event so it can shut
    down cleanly (``Runtime.run`` for a process that also wants the bus)."""
    stop = asyncio.Event()
    return _run_with_signals(lambda: main(stop), stop.set)


def _run_with_signals(main: Callable[[], Awaitable[T]], on_signal: Callable[[], None]) -> T:
    async def runner() -> T:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        return await main()

    return asyncio.run(runner())


# -- the broker -----------------------------------------------------------------------------------

def require_bootstrap(cfg: "PipelineConfig") -> None:
    """A broker is configured and answers; else one line that says what to do."""
    if not cfg.bus.bootstrap_servers:
        raise StreamrlError(NO_BROKER)
    probe_bootstrap(cfg.bus.bootstrap_servers)


def probe_bootstrap(servers: str, timeout_s: float = 10.0) -> None:
    """At least one of ``servers`` accepts a TCP connection within ``timeout_s``; else a
    ``StreamrlError`` naming every address and what to check. The Kafka client itself would retry
    for a minute and end in a traceback."""
    addresses = [a.strip() for a in servers.split(",") if a.strip()]
    deadline = time.monotonic() + timeout_s
    reasons = []
    while True:
        reasons.clear()
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise StreamrlError(f"--bootstrap-servers: {address!r} is not HOST:PORT")
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                    return
            except OSError as exc:
                reasons.append(f"{address} ({exc.strerror or exc})")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise StreamrlError(f"cannot reach Kafka at {', '.join(reasons)} after {timeout_s:.0f} s: check the address "
                        f"(--bootstrap-servers / STREAMRL_BOOTSTRAP_SERVERS), that the broker runs, and that "
                        f"its port is open from this machine; leave it empty for the embedded broker")


@contextlib.contextmanager
def open_broker(cfg: "PipelineConfig", die_with_parent: bool = False
                ) -> Iterator[tuple[str, "EmbeddedBroker | None"]]:
    """``(bootstrap, embedded broker or None)``: the configured broker (checked to answer), or an
    embedded one for the duration of the block, set as ``cfg.bus.bootstrap_servers``
    (``die_with_parent``: it ends with this process, so a SIGKILLed run leaves none behind)."""
    if cfg.bus.bootstrap_servers:
        probe_bootstrap(cfg.bus.bootstrap_servers)
        yield cfg.bus.bootstrap_servers, None
        return

    with EmbeddedBroker(die_with_parent=die_with_parent) as broker:
        cfg.bus.bootstrap_servers = broker.bootstrap
        print(f"embedded broker: {broker.bootstrap} (pid {broker.proc.pid})", file=sys.stderr, flush=True)
        yield broker.bootstrap, broker


@contextlib.contextmanager
def broker_for(cfg: "PipelineConfig") -> Iterator[str]:
    """The bootstrap address of ``open_broker(cfg)``: the configured broker, or an embedded one
    for the duration of the block."""
    with open_broker(cfg) as (bootstrap, _):
        yield bootstrap
