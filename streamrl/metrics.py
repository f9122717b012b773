"""Every Prometheus metric streamrl exports, declared once, here.

Names follow ``streamrl_<stage>_<what>_<unit>``; labels are bounded (stage, topic, partition,
group, scorer, reason, url): never a trajectory or group id. Each long-running process serves
the default registry on its own port (``serve``), so processes sharing a host do not collide.
"""

from __future__ import annotations

import socket

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# -- bus: every consuming / producing stage -----------------------------------------------------
BUS_CONSUMED = Counter("streamrl_bus_consumed_records_total", "Records taken from a topic",
                       ["stage", "topic"])
BUS_PRODUCED = Counter("streamrl_bus_produced_records_total", "Records acknowledged by the broker",
                       ["stage", "topic"])
BUS_PRODUCED_BYTES = Counter("streamrl_bus_produced_bytes_total", "Bytes of records acknowledged",
                             ["stage", "topic"])
BUS_DEADLETTERS = Counter("streamrl_bus_deadletter_records_total",
                          "Records sent to the dead-letter topic", ["stage", "reason"])
BUS_IN_FLIGHT = Gauge("streamrl_bus_in_flight_records", "Records taken but not yet finished",
                      ["stage"])
BUS_COMMITS = Counter("streamrl_bus_commits_total", "Offset commits", ["stage"])
BUS_COMMIT_ERRORS = Counter("streamrl_bus_commit_errors_total", "Failed offset commits", ["stage"])
BUS_HANDLER_SECONDS = Histogram("streamrl_bus_handle_seconds", "Time from taking a record to its "
                                "outputs being acknowledged", ["stage"],
                                buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
CONSUMER_LAG = Gauge("streamrl_consumer_lag_records",
                     "Log end offset minus committed offset, per partition",
                     ["stage", "group", "topic", "partition"])
CONSUMER_LAST_PROGRESS = Gauge("streamrl_consumer_last_progress_timestamp_seconds",
                               "Unix time of the last finished record", ["stage", "group"])


def serve(port: int = 0, host: str = "0.0.0.0") -> int:
    """Serve the registry on ``port`` (0: a free one) and return the port."""
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    start_http_server(port, addr=host)
    return port
