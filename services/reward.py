"""The reward service: ``python services/reward.py --bootstrap-servers HOST:PORT [--config FILE]
[--group ID]`` (the same as ``streamrl reward ...``); run several for a bigger consumer group."""

import sys

from streamrl.cli import main

raise SystemExit(main(["reward", *sys.argv[1:]]))
