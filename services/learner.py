"""The learner service: ``python services/learner.py --bootstrap-servers HOST:PORT --config FILE``
(the same as ``streamrl learner ...``)."""

import sys

from streamrl.cli import main

raise SystemExit(main(["learner", *sys.argv[1:]]))
