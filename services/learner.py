"""The learner stage as a process: `python services/learner.py [--config FILE] [--bootstrap-servers
HOST:PORT] [key.path=value ...]`, the same as `streamrl learner` (both run it in the runtime,
`streamrl.runtime.serve_stage`)."""

from streamrl.commands.common import stage_main
from streamrl.learner.stage import Learner

if __name__ == "__main__":
    raise SystemExit(stage_main(Learner))
