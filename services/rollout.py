"""The rollout service: ``python services/rollout.py --bootstrap-servers HOST:PORT --config FILE``
is ``streamrl rollout`` with the same arguments."""

import sys

from streamrl.cli import main

raise SystemExit(main(["rollout", *sys.argv[1:]]))
