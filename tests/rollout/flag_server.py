"""A policy server launched as ``vllm serve`` or ``python -m sglang.launch_server`` would be, for
the tests of the flags streamrl starts them with: it reads its command line with the flags' real
names and value grammar (``--hf-overrides`` / ``--json-model-override-args``: JSON), loads the
model's config with the overrides applied (transformers' ``AutoConfig``: what the engine would
build the model from), and serves ``/health`` and ``/v1/models``, whose entry carries what it
read (``streamrl_flags``) and the config it built (``streamrl_config``). A flag it cannot read
makes it exit, as the real servers do.

    python -m tests.rollout.flag_server vllm serve MODEL --host H --port P [flags]
    python -m tests.rollout.flag_server sglang --model-path MODEL --host H --port P [flags]
    python -m tests.rollout.flag_server trtllm MODEL --host H --port P [flags]  (as trtllm-serve)
"""

from __future__ import annotations

import argparse
import json
import sys

from aiohttp import web


def parse(argv: list[str]) -> argparse.Namespace:
    kind, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=kind)
    if kind == "vllm":
        p.add_argument("verb", choices=["serve"])
        p.add_argument("model")
        p.add_argument("--hf-overrides", type=json.loads, default={})
        p.add_argument("--tensor-parallel-size", type=int, default=1)
        p.add_argument("--worker-extension-cls", default="")
    elif kind == "trtllm":  # trtllm-serve's click options (tensorrt_llm/commands/serve.py)
        p.add_argument("model")
        p.add_argument("--tensor_parallel_size", "--tp_size", type=int, default=1)
        p.add_argument("--backend", choices=["pytorch", "tensorrt", "_autodeploy"], default="pytorch")
        p.add_argument("--config", "--extra_llm_api_options", dest="config", default=None)
    else:
        p.add_argument("--model-path", dest="model", required=True)
        p.add_argument("--json-model-override-args", dest="hf_overrides", type=json.loads, default={})
        p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    if kind != "trtllm":
        p.add_argument("--quantization", default=None)
        p.add_argument("--quantization-param-path", default=None)
    args = p.parse_args(rest)
    args.kind = kind
    return args


def main() -> None:
    args = parse(sys.argv[1:])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    for key, value in getattr(args, "hf_overrides", {}).items():  # both engines set each top-level field
        setattr(config, key, value)
    flags = {k: v for k, v in vars(args).items() if k not in ("host", "port")}

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": args.model, "object": "model", "streamrl_flags": flags, "streamrl_config": config.to_dict()}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
