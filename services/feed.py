"""The feed stage as a process: `python services/feed.py [--config FILE] [--bootstrap-servers
HOST:PORT] [key.path=value ...]`, the same as `streamrl feed` (both run it in the runtime,
`streamrl.runtime.serve_stage`)."""

from streamrl.commands.common import stage_main
from streamrl.feed.stage import Feed

if __name__ == "__main__":
    raise SystemExit(stage_main(Feed))
