"""Arguments and start-up shared by the verbs: config loading, the broker address, signals."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from typing import Any, Awaitable, Callable, ClassVar, Iterator, Protocol

from streamrl.pipeline_config import PipelineConfig, load_config
from streamrl.errors import StreamrlError


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = False) -> None:
    parser.add_argument("--config", required=config_required,
                        help="pipeline YAML: a file, or a packaged config by name (local.yaml, gsm8k.yaml)")
    add_bootstrap_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="config overrides, e.g. reward.max_in_flight=128")


def add_bootstrap_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", default=os.environ.get("STREAMRL_BOOTSTRAP_SERVERS", ""),
                        help="Kafka HOST:PORT[,...] (env STREAMRL_BOOTSTRAP_SERVERS); "
                             "empty: the embedded broker where the verb can start one")


def load(args: argparse.Namespace) -> PipelineConfig:
    """The config from ``--config`` and overrides, with ``--bootstrap-servers`` applied; a bad
    field exits with its name."""
    cfg = load_config(getattr(args, "config", None), getattr(args, "overrides", ()) or ())
    if getattr(args, "bootstrap_servers", ""):
        cfg.bus.bootstrap_servers = args.bootstrap_servers
    return cfg


def require_bootstrap(cfg: PipelineConfig) -> None:
    """A broker is configured and answers; else one line that says what to do."""
    if not cfg.bus.bootstrap_servers:
        raise StreamrlError("no broker: pass --bootstrap-servers HOST:PORT or set "
                            "STREAMRL_BOOTSTRAP_SERVERS (start one with `streamrl broker`)")
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
def broker_for(cfg: PipelineConfig) -> Iterator[str]:
    """The configured broker (checked to answer), or an embedded one for the duration of the
    block."""
    if cfg.bus.bootstrap_servers:
        probe_bootstrap(cfg.bus.bootstrap_servers)
        yield cfg.bus.bootstrap_servers
        return
    from streamrl.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        cfg.bus.bootstrap_servers = broker.bootstrap
        print(f"embedded broker: {broker.bootstrap}", file=sys.stderr, flush=True)
        yield broker.bootstrap


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[Any]]) -> Any:
    """Run ``main(stop_event)``; SIGINT/SIGTERM set the event so it can shut down cleanly."""

    async def runner() -> Any:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return asyncio.run(runner())


class Stage(Protocol):
    """What every stage (feed, rollout, reward, learner) offers ``serve_stage``."""

    name: ClassVar[str]

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> "Stage":
        """Build it (load models, build the scorer table); connect nothing yet."""

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad field."""

    def describe(self) -> str:
        """One line for the start-up banner."""

    async def run(self, stop: asyncio.Event) -> Any:
        """Work until done or ``stop`` is set; drain, commit, leave."""


def serve_stage(stage_cls: type[Stage], args: argparse.Namespace, **fields: Any) -> int:
    """Run one stage as a process: the config (``--config``, overrides, then the verb's own flags
    in ``fields`` as ``section__field=value``, None meaning not given), the stage built and
    validated before anything connects (a bad config fails here, naming its field), the broker
    checked, metrics served on the port it prints, SIGINT/SIGTERM for a clean stop. The CLI
    verbs, ``services/*.py``, compose, Kubernetes and the launchers of ``streamrl run`` all start
    stages through this one function."""
    from streamrl import metrics

    cfg = load(args)
    for key, value in fields.items():
        if value is not None and value != "":
            section, _, name = key.partition("__")
            setattr(getattr(cfg, section), name, value)

    async def main(stop: asyncio.Event) -> Any:
        stage = stage_cls.from_config(cfg)  # inside the loop: the Kafka client wants a running one
        stage.validate()
        await asyncio.to_thread(require_bootstrap, cfg)
        from streamrl.bus import Bus
        from streamrl.topics import ensure_topics

        await ensure_topics(Bus(cfg.bus))
        port = metrics.serve(cfg.metrics.port, cfg.metrics.host)
        print(f"metrics: http://{cfg.metrics.host}:{port}/metrics", flush=True)
        print(f"{stage_cls.name}: {stage.describe()}", flush=True)
        from streamrl.broker import watch_broker

        watch = asyncio.create_task(watch_broker(cfg.bus.bootstrap_servers, cfg.bus.unavailable_timeout_s,
                                                 stop, stage_cls.name))
        work = asyncio.create_task(stage.run(stop))
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        gone = watch.result() if watch.done() else None
        if gone:  # the stage was told to stop; with no broker its drain may never finish
            print(f"{stage_cls.name}: {gone}: stopping", file=sys.stderr, flush=True)
            done, _ = await asyncio.wait([work], timeout=30)
            if not done:
                os._exit(1)
            return 1
        watch.cancel()
        await work
        print(f"{stage_cls.name}: stopped, {stage.describe()}", flush=True)
        return 0

    return run_until_signalled(main)


def stage_main(stage_cls: type[Stage], argv: list[str] | None = None) -> int:
    """``python services/<stage>.py [--config FILE] [--bootstrap-servers HOST:PORT] [key=value ...]``:
    the stage's process without the ``streamrl`` command around it; errors as the CLI prints them."""
    parser = argparse.ArgumentParser(prog=f"services/{stage_cls.name}.py",
                                     description=f"the {stage_cls.name} stage (as `streamrl {stage_cls.name}`)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve_stage(stage_cls, args)
    except StreamrlError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
