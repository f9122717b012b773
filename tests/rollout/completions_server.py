"""A real ``POST /v1/completions`` server in the test process on the tiny transformers model, as
``vllm serve`` answers (vLLM's token-id extensions included): the OpenAI-compatible backend's,
the agent loops' and the gateway's tests stand their fleet on it."""

from __future__ import annotations

import base64
import io

import numpy as np
from aiohttp import web

from streamrl.rollout.backends import SamplingParams
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from tests.helpers import serve_app


class CompletionsServer:
    """``POST /v1/completions`` on the tiny model, vLLM's token-id extensions included. It can
    be told to fail the next requests with a status."""

    def __init__(self, engine: TransformersBackend, routed_format: str = ""):
        """``routed_format`` (an engine recording its routing): return it as vLLM does
        (``vllm``: each choice's ``routed_experts``, base64 of a ``.npy``) or SGLang does
        (``sglang``: ``sglext.routed_experts``, base64 of flat int32, when the request asks)."""
        self.engine = engine
        self.routed_format = routed_format
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_next: list[int] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_next:
            return web.json_response({"error": {"message": "busy"}}, status=self.fail_next.pop(0))
        if body.get("max_tokens", 16) > 64:
            return web.json_response({"error": {"message": "max_tokens too large"}}, status=400)
        if "REFUSE" in str(body["prompt"]):
            return web.json_response({"error": {"message": "prompt is too long"}}, status=400)
        params = SamplingParams(max_new_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 1.0),
                                top_p=body.get("top_p", 1.0), ignore_eos=body.get("ignore_eos", False))
        (samples,) = await self.engine.generate([body["prompt"]], body.get("n", 1), params)
        choices = []
        for i, s in enumerate(samples):
            tokens = ([f"token_id:{t}" for t in s.response_ids] if body.get("return_tokens_as_token_ids")
                      else [self.engine.tokenizer.decode([t]) for t in s.response_ids])
            choice = {"index": i, "text": s.text, "finish_reason": s.finish_reason,
                      "logprobs": {"tokens": tokens, "token_logprobs": [float(x) for x in s.response_logprobs]}}
            if body.get("return_token_ids"):
                choice.update(token_ids=s.response_ids, prompt_token_ids=s.prompt_ids)
            if self.routed_format == "vllm":
                buf = io.BytesIO()
                np.save(buf, s.routed_experts.astype(np.uint8))
                choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
            choices.append(choice)
        out = {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
               "choices": list(reversed(choices))}  # order comes from "index"
        if self.routed_format == "sglang" and body.get("return_routed_experts"):
            out["sglext"] = {"routed_experts": base64.b64encode(samples[0].routed_experts.astype("<i4").tobytes()).decode()}
        return web.json_response(out)


async def start_server(server: CompletionsServer, port: int = 0) -> tuple[web.AppRunner, str]:
    runner, url = await serve_app(server.app, port)
    return runner, f"{url}/v1"
