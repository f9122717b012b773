"""A member of the sandbox group as a process: `python services/sandbox.py [--host H] [--port P]
[--slots N] ...`, the same as `streamrl sandbox` (policy-written code run isolated behind
SandboxFusion's HTTP API: docs/guides/sandbox.md). Not a Kafka stage: the reward group calls it."""

import sys

from streamrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["sandbox", *sys.argv[1:]]))
