"""The rollout stage as a process: `python services/rollout.py [--config FILE] [--bootstrap-servers
HOST:PORT] [key.path=value ...]`, the same as `streamrl rollout` (both run it in the runtime,
`streamrl.runtime.serve_stage`)."""

from streamrl.commands.common import stage_main
from streamrl.rollout.worker import RolloutWorker

if __name__ == "__main__":
    raise SystemExit(stage_main(RolloutWorker))
