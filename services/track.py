"""The experiment trackers as a process: `python services/track.py [--config FILE]
[--bootstrap-servers HOST:PORT] tracking.loggers=[tensorboard] tracking.dir=DIR [key.path=value
...]`, the same as `streamrl track` (both run it in the runtime, `streamrl.runtime.serve_stage`)."""

from streamrl.commands.common import stage_main
from streamrl.tracking.trackers import TrackingStage

if __name__ == "__main__":
    raise SystemExit(stage_main(TrackingStage))
