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
from typing import Any, Awaitable, Callable, Iterator

from streamrl.config import PipelineConfig, load_config
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
