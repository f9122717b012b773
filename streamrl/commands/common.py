"""Arguments and start-up shared by the verbs: config loading, the broker address, signals."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import Any, Awaitable, Callable, Iterator

from streamrl.config import ConfigError, PipelineConfig, load_config


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = False) -> None:
    parser.add_argument("--config", required=config_required, help="pipeline YAML (configs/*.yaml)")
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
    try:
        cfg = load_config(getattr(args, "config", None), getattr(args, "overrides", ()) or ())
    except ConfigError as exc:
        raise SystemExit(f"streamrl: {exc}") from None
    if getattr(args, "bootstrap_servers", ""):
        cfg.bus.bootstrap_servers = args.bootstrap_servers
    return cfg


def require_bootstrap(cfg: PipelineConfig) -> None:
    if not cfg.bus.bootstrap_servers:
        raise SystemExit("streamrl: no broker: pass --bootstrap-servers HOST:PORT or set "
                         "STREAMRL_BOOTSTRAP_SERVERS (start one with `streamrl broker`)")


@contextlib.contextmanager
def broker_for(cfg: PipelineConfig) -> Iterator[str]:
    """The configured broker, or an embedded one for the duration of the block."""
    if cfg.bus.bootstrap_servers:
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
