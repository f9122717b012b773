"""The eval stage as a process: `python services/eval.py [--config FILE] [--bootstrap-servers
HOST:PORT] [eval.dataset=...] [key.path=value ...]`, the same as `streamrl eval` (both run it in
the runtime, `streamrl.runtime.serve_stage`)."""

from streamrl.commands.common import stage_main
from streamrl.evaluation.stage import Evaluator

if __name__ == "__main__":
    raise SystemExit(stage_main(Evaluator))
