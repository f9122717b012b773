"""The reward stage as a process: `python services/reward.py [--config FILE] [--bootstrap-servers
HOST:PORT] [key.path=value ...]`, the same as `streamrl reward` (both run it in the runtime,
`streamrl.runtime.serve_stage`)."""

from streamrl.commands.common import stage_main
from streamrl.reward.stage import RewardStage

if __name__ == "__main__":
    raise SystemExit(stage_main(RewardStage))
