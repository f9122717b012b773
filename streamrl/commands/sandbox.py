"""``streamrl sandbox``: one member of the sandbox group, serving SandboxFusion's HTTP API
(``/run_code``) for the code scorer, verl's sandbox client, or any SandboxFusion user. Each
program runs isolated (docs/guides/sandbox.md); run more members behind one address to scale."""

from __future__ import annotations

import argparse
import os

HELP = "run policy-written code, isolated, behind SandboxFusion's HTTP API (/run_code)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=os.environ.get("STREAMRL_SANDBOX_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("STREAMRL_SANDBOX_PORT", "8080")),
                        help="HTTP port for /run_code, /health, /v1/ping and /metrics (0: a free one)")
    parser.add_argument("--slots", type=int, default=0, help="programs run at once (0: the CPU count)")
    parser.add_argument("--python", default="", help="the interpreter for language python (under /usr: the "
                                                     "sandbox sees /usr only; default /usr/bin/python3)")
    parser.add_argument("--max-run-timeout", type=float, default=30.0, help="the most run_timeout a request gets (s)")
    parser.add_argument("--max-memory-mb", type=int, default=2048, help="the most memory_limit_MB a request gets")
    parser.add_argument("--default-memory-mb", type=int, default=1024, help="memory for memory_limit_MB -1")
    parser.add_argument("--processes", type=int, default=64, help="processes and threads per execution")
    parser.add_argument("--scratch-mb", type=int, default=64, help="size of the scratch tmpfs (/tmp)")
    parser.add_argument("--max-output-bytes", type=int, default=8 << 20, help="stdout and stderr cap, each")
    parser.add_argument("--uid-base", type=int, default=61000,
                        help="started as root: slot i runs as uid uid-base+i (processes are counted per uid: "
                             "give each service on a host its own range)")
    parser.add_argument("--allow-unisolated", action="store_true",
                        help="run code below the documented minimum isolation (no bubblewrap or no user "
                             "namespaces): only for code you trust")


def main(args: argparse.Namespace) -> int:
    from aiohttp import web

    from streamrl.net import free_port
    from streamrl.sandbox.isolation import Executor, Limits, probe
    from streamrl.sandbox.server import ServiceLimits, build_app, default_slots

    isolation = probe(args.python)
    executor = Executor(isolation, slots=args.slots or default_slots(), python=args.python,
                        allow_unisolated=args.allow_unisolated, uid_base=args.uid_base)  # refuses below the minimum
    limits = ServiceLimits(max_run_timeout_s=args.max_run_timeout, max_memory_mb=args.max_memory_mb,
                           default_memory_mb=args.default_memory_mb,
                           base=Limits(processes=args.processes, scratch_mb=args.scratch_mb,
                                       output_bytes=args.max_output_bytes))
    port = args.port or free_port(args.host)
    print(f"streamrl sandbox: {isolation.describe()}", flush=True)
    if isolation.level != "namespaces":
        print(f"streamrl sandbox: WARNING: running code UNISOLATED (--allow-unisolated): "
              f"{'; '.join(isolation.problems)}", flush=True)
    print(f"streamrl sandbox: languages {', '.join(executor.languages())}; {executor.n_slots} slots", flush=True)
    print(f"streamrl sandbox: serving http://{args.host}:{port}/run_code (metrics: /metrics, health: /health)",
          flush=True)
    web.run_app(build_app(executor, limits), host=args.host, port=port, access_log=None, print=None)
    return 0
