"""streamrl's own reward-model server: a transformers model behind vLLM's pooling API.

``python -m streamrl.scorers.rm_server --model PATH --port N [--device cpu|cuda]`` serves

- ``GET /health``: 200 once the model is loaded (it is loaded before the port opens);
- ``GET /version``: ``{"version": streamrl's, "engine": "streamrl"}`` (so a model scorer knows it
  reads ``use_activation``);
- ``GET /v1/models``: the served model, as vLLM lists it;
- ``POST /classify`` (and ``/v1/classify``): vLLM's classification request and response.
  ``input`` is a string, a list of strings (tokenised with special tokens added, as vLLM does),
  or token ids (a list of ints, or a list of such lists: used as given). ``use_activation``
  (or the older ``activation``) false returns the raw logit, as a reward model's score; by
  default, as in vLLM, the sigmoid of it. The answer is ``{"object": "list", "data": [{"index",
  "label", "probs": [p], "num_classes": 1}], "usage": {...}}``.

It runs ``TransformersRewardModel`` (``streamrl.scorers.model.local``): the same sorting by length and
the same split into forward passes of at most ``--max-batch-tokens`` padded tokens as the local
backend; requests are scored one at a time (the model scorer already sends batches). It is the
``transformers`` backend of ``reward.servers``: a reward model on CPU (or a GPU without vLLM)
that the reward stage launches and supervises like a vLLM server, so that path runs end to end
on any machine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
import uuid
from typing import Any

from aiohttp import web

from streamrl import __version__
from streamrl.scorers.model.config import ModelScorerConfig

log = logging.getLogger("streamrl.rm_server")


def _features(model: Any, raw: Any) -> list[dict[str, list[int]]]:
    """The request's ``input`` as token features, or ``ValueError`` saying what is wrong."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ValueError("'input' must be a non-empty string, list of strings or token ids")
    if all(isinstance(x, int) for x in raw):
        raw = [raw]
    if all(isinstance(x, str) for x in raw):
        return model.encode_texts(raw)
    if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in raw):
        return [{"input_ids": list(x)[: model.max_length]} for x in raw]
    raise ValueError("'input' must be a non-empty string, list of strings or token ids")


def _use_activation(body: dict[str, Any]) -> bool:
    for name in ("use_activation", "activation"):
        if body.get(name) is not None:
            return bool(body[name])
    return True  # vLLM's default for classification


def build_app(model: Any, served_name: str) -> web.Application:
    """The aiohttp application over a loaded ``TransformersRewardModel``."""
    lock = asyncio.Lock()  # one forward at a time: torch already uses every thread it has

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": __version__, "engine": "streamrl"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": served_name, "object": "model", "owned_by": "streamrl",
             "max_model_len": model.max_length}]})

    async def classify(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            if body.get("model") not in (None, "", served_name):
                return web.json_response({"object": "error", "message": f"model {body['model']!r} "
                                          f"is not served here ({served_name!r})", "code": 404}, status=404)
            features = _features(model, body.get("input"))
        except ValueError as exc:
            return web.json_response({"object": "error", "message": str(exc), "code": 400}, status=400)
        async with lock:
            logits = await asyncio.to_thread(model.score_features, features)
        activate = _use_activation(body)
        data = []
        for i, x in enumerate(logits.tolist()):
            p = 1.0 / (1.0 + math.exp(-x)) if activate else x
            data.append({"index": i, "label": "LABEL_0", "probs": [p], "num_classes": 1})
        tokens = sum(len(f["input_ids"]) for f in features)
        return web.json_response({
            "id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": served_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/classify", classify)
    app.router.add_post("/v1/classify", classify)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m streamrl.scorers.rm_server",
                                     description="A reward model behind vLLM's /classify API.")
    parser.add_argument("--model", required=True, help="model directory or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=32768)
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="seeds a head the checkpoint lacks")
    parser.add_argument("--served-model-name", default="", help="default: --model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from streamrl.scorers.model.local import TransformersRewardModel

    model = TransformersRewardModel(ModelScorerConfig(
        model_path=args.model, device=args.device, dtype=args.dtype, max_length=args.max_length,
        max_batch_tokens=args.max_batch_tokens, num_threads=args.num_threads, seed=args.seed))
    name = args.served_model_name or args.model
    log.info("serving %s on %s:%d (device %s)", name, args.host, args.port, model.device)
    web.run_app(build_app(model, name), host=args.host, port=args.port, access_log=None,
                print=None, reuse_address=True)


if __name__ == "__main__":
    main()
