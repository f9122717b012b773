"""The teacher stage as a process: `python services/teacher.py [--config FILE] [--bootstrap-servers
HOST:PORT] [key.path=value ...]`, the same as `streamrl teacher` (both run it in the runtime,
`streamrl.runtime.serve_stage`)."""

from streamrl.commands.common import stage_main
from streamrl.distillation.stage import TeacherStage

if __name__ == "__main__":
    raise SystemExit(stage_main(TeacherStage))
