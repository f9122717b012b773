"""``streamrl broker``: the embedded Kafka-compatible broker in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys

HELP = "run the embedded broker (Tansu, memory storage) in the foreground"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:9092", metavar="HOST:PORT",
                        help="address to listen on and advertise (port 0: a free one)")


def main(args: argparse.Namespace) -> int:
    from streamrl.broker import BrokerError, EmbeddedBroker

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"streamrl broker: --listen wants HOST:PORT, got {args.listen!r}")
    broker = EmbeddedBroker(host=host, port=int(port))
    try:
        broker.start()
    except BrokerError as exc:
        print(f"streamrl broker: {exc}", file=sys.stderr)
        return 1
    print(f"bootstrap: {broker.bootstrap}", flush=True)
    stopping = False

    def on_signal(signum, _frame):
        # Only pass the signal on: the main thread is inside wait() and reaps the child.
        nonlocal stopping
        stopping = True
        broker.terminate()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = broker.wait()
    return 0 if stopping else (code or 1)
