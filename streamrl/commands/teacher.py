"""``streamrl teacher``: one member of a teacher consumer group (on-policy distillation; run
more for more throughput: Kafka spreads the input's partitions over them). With several teachers
(verl's ``distillation.teacher_models``, one per data source) ``--teacher NAME`` says which:
each teacher is its own group."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, load

HELP = "annotate trajectories with a teacher's log-probs into distilled (one member of the teacher group)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--group", default="", help="consumer group id (default: teacher.group; with several "
                        "teachers, each group is <group>-<NAME>)")
    parser.add_argument("--teacher", default="", metavar="NAME",
                        help="with several teachers (distillation.teacher_models): the one this member runs")


def main(args: argparse.Namespace) -> int:
    from streamrl.distillation.stage import TeacherStage
    from streamrl.runtime import serve_stage

    return serve_stage(TeacherStage, load(args, teacher__group=args.group, teacher__name=args.teacher))
