"""The arguments the verbs share: the config (``--config``, overrides, the verb's own flags)
and the broker's address. What a process does with them is the runtime's
(``streamrl.runtime``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from streamrl.errors import StreamrlError
from streamrl.pipeline_config import PipelineConfig, load_config
from streamrl.runtime import Stage, serve_stage


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


def load(args: argparse.Namespace, **fields: Any) -> PipelineConfig:
    """The config from ``--config`` and overrides, with ``--bootstrap-servers`` applied, then the
    verb's own flags in ``fields`` as ``section__field=value`` (None or "" meaning not given); a
    bad field exits with its name."""
    cfg = load_config(getattr(args, "config", None), getattr(args, "overrides", ()) or ())
    if getattr(args, "bootstrap_servers", ""):
        cfg.bus.bootstrap_servers = args.bootstrap_servers
    for key, value in fields.items():
        if value is not None and value != "":
            section, _, name = key.partition("__")
            setattr(getattr(cfg, section), name, value)
    return cfg


def stage_main(stage_cls: type[Stage], argv: list[str] | None = None) -> int:
    """``python services/<stage>.py [--config FILE] [--bootstrap-servers HOST:PORT] [key=value ...]``:
    the stage's process without the ``streamrl`` command around it; errors as the CLI prints them."""
    parser = argparse.ArgumentParser(prog=f"services/{stage_cls.name}.py",
                                     description=f"the {stage_cls.name} stage (as `streamrl {stage_cls.name}`)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve_stage(stage_cls, load(args))
    except StreamrlError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
