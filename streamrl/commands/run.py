"""``streamrl run [CONFIG]``: the whole pipeline on the embedded broker (or ``--bootstrap-servers``):
broker, topics, learner, reward group, rollout workers and the prompt feed, each its own process
(or Ray actor), with a live status line; at the end a summary, a plot, and one JSON line.

The run's life (docs/guides/lifecycle.md): it ends when the learner ends (its data is
exhausted, or ``learner.versions`` is reached); the stages then stop in pipeline order (feed and
rollout workers, then the reward group once it has scored what is in ``rollouts``, then the
learner). ``--resume [RUN_DIR]`` (``run.resume``) continues a stopped run from its learner's
checkpoint. A fresh run refuses topics that hold another run's records. The embedded broker is
supervised: if it dies, every stage is stopped and the run fails naming it. The supervisor that
does all this is ``streamrl.supervisor``."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_bootstrap_argument
from streamrl.supervisor.plan import DEFAULT_CONFIG

HELP = "run the whole pipeline (embedded broker by default) and print a JSON summary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                        help=f"pipeline YAML: a file or a packaged name (default {DEFAULT_CONFIG}, the embedded default)")
    add_bootstrap_argument(parser)
    parser.add_argument("--run-dir", metavar="DIR", help="where runs go (run.out_dir, default ./runs): DIR/<run id>/")
    parser.add_argument("--launcher", choices=["local", "ray"], help="run.launcher: processes here, or Ray actors")
    parser.add_argument("--autoscale", metavar="MIN:MAX", help="size the reward group by its consumer lag")
    parser.add_argument("--resume", nargs="?", const="auto", metavar="RUN_DIR",
                        help="continue a stopped run (run.resume): RUN_DIR, or the newest unfinished one "
                             "under run.out_dir")
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve and check the config without starting anything (no broker, model download or "
                             "network): print it as YAML, then what each verl key given became; exit 0 where "
                             "`streamrl run` would start, 2 otherwise, listing every problem")
    parser.add_argument("--verl-entry", metavar="MODULE",
                        help="the module a verl launch script runs (python -m MODULE, e.g. recipe.dapo.main_dapo): "
                             "run.verl_entry, its recipe's algorithm trained or refused naming it")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")


def main(args: argparse.Namespace) -> int:
    from streamrl.supervisor.run import run

    return run(args)
