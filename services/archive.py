"""The archive stage as a process: `python services/archive.py [--config FILE] [--bootstrap-servers
HOST:PORT] [archive.uri=PATH|URI] [key.path=value ...]`, the same as `streamrl archive` (both run
it in the runtime, `streamrl.runtime.serve_stage`)."""

from streamrl.archive.stage import ArchiveStage
from streamrl.commands.common import stage_main

if __name__ == "__main__":
    raise SystemExit(stage_main(ArchiveStage))
