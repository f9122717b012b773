"""A server fleet following versions published by delta (``learner.weights_delta``): the rollout
worker rebuilds each delta into a full directory beside the servers, and the servers load it
through their real load path: streamrl's vLLM worker extension (``streamrl_load_weights``,
mixed into a worker whose model records the tensors it is handed) behind vLLM's dev-mode
``/collective_rpc``, and SGLang's ``/update_weights_from_disk`` reading the directory's
safetensors. Every tensor a server loads is the full version's, bit for bit. A corrupt delta
fails the load (the server out of rotation, the failure counted), the fleet retries, and the next
full version loads."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from aiohttp import web

from streamrl import metrics, weights
from streamrl.policy import load_policy
from streamrl.rollout.backends import SamplingParams
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.vllm_extension import WeightFollowerExtension
from streamrl.weights import delta, iter_safetensors, save_policy
from tests.helpers import AppServer, wait_for
from tests.rollout.streaming import reply


def digest(tensors) -> str:
    h = hashlib.sha256()
    for name, t in sorted(tensors):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Model:
    def __init__(self):
        self.loaded: list = []

    def load_weights(self, weights):
        self.loaded = list(weights)


class _Runner:
    def __init__(self):
        self.model = _Model()


class LoadingServer(AppServer):
    """A policy server that loads what it is told to: vLLM's ``/collective_rpc`` through
    streamrl's worker extension, SGLang's ``/update_weights_from_disk`` by reading the
    directory's safetensors; it answers completions with the digest of the weights it holds."""

    def __init__(self):
        self.worker = type("Worker", (WeightFollowerExtension,), {})()
        self.worker.model_runner = _Runner()
        self.held = ""
        self.paths: list[str] = []

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._ok)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/collective_rpc", self._vllm)
        app.router.add_post("/reset_prefix_cache", self._ok)
        app.router.add_post("/update_weights_from_disk", self._sglang)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        choice = {"index": 0, "text": self.held, "finish_reason": "stop", "token_ids": [5], "prompt_token_ids": [1],
                  "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]}}
        return await reply(request, body, [choice])  # JSON, or server-sent events when it asks for a stream

    async def _vllm(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.paths.append(body["args"][0])
        try:
            self.worker.streamrl_load_weights(body["args"][0])
        except FileNotFoundError as exc:
            return web.json_response({"error": str(exc)}, status=500)
        self.held = digest(self.worker.model_runner.model.loaded)
        return web.json_response({"results": [1]})

    async def _sglang(self, request: web.Request) -> web.Response:
        path = (await request.json())["model_path"]
        self.paths.append(path)
        self.held = digest(iter_safetensors(Path(path)))
        return web.json_response({"success": True, "message": "ok"})


def chain(root: Path, versions: int) -> tuple[Path, dict[int, str]]:
    """Versions 1..N of the tiny policy, each a small change of the one before, published by a
    ``DeltaWriter`` (full every 3: v1 and v4 full); the digest of each full version."""
    model, tok = load_policy("tiny", seed=3)
    writer = delta.DeltaWriter(full_every=3)
    digests = {}
    gen = torch.Generator().manual_seed(0)
    for v in range(1, versions + 1):
        with torch.no_grad():
            for p in model.parameters():
                mask = torch.rand(p.shape, generator=gen) < 0.05
                p.add_(mask * torch.randn(p.shape, generator=gen) * 1e-3)
        path = save_policy(model, tok, root / f"v{v}")
        digests[v] = digest(iter_safetensors(path))
        writer.publish(path, v)
    return root, digests


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_servers_load_rebuilt_deltas_and_a_corrupt_one_waits_for_the_full_version(tmp_path, monkeypatch, api):
    monkeypatch.setenv("STREAMRL_WEIGHTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "reconstructor", delta.Reconstructor())
    root, digests = chain(tmp_path / "weights", 5)
    assert [delta.read_manifest(root / f"v{v}")["kind"] for v in range(1, 6)] == ["full", "delta", "delta", "full",
                                                                                  "delta"]
    frame = root / "v3" / f"model.safetensors{delta.SUFFIX}"
    shutil.copy(frame, tmp_path / "v3-good")
    failures = metrics.ROLLOUT_SERVER_UPDATE_FAILURES

    async def held_by(backend, server, version):
        await wait_for(lambda: backend.fleet.members[server.url].version == version, timeout_s=30,
                       what=f"the server on v{version}")
        (sample,) = (await backend.generate(["hi"], 1, SamplingParams()))[0]
        return sample.text

    async def go():
        servers = [await LoadingServer().start(), await LoadingServer().start()]
        backend = OpenAIBackend("", "policy", servers=[s.url for s in servers], update_api=api, health_interval_s=0,
                                update_retry_s=0.05)
        try:
            await backend.load_weights(str(root / "v2"), 2)  # a delta: v1 (full) + v2, rebuilt beside them
            for s in servers:
                assert await held_by(backend, s, 2) == digests[2]
            assert all(delta.MANIFEST not in p and "full-" in p for s in servers for p in s.paths)
            good = frame.read_bytes()
            frame.write_bytes(good[: len(good) // 2])  # v3's delta arrives truncated
            before = sum(failures.labels(m)._value.get() for m in backend.fleet.members)
            await backend.load_weights(str(root / "v3"), 3)
            await wait_for(lambda: sum(failures.labels(m)._value.get() for m in backend.fleet.members) > before,
                           timeout_s=30, what="the failed load counted")
            assert all(m.out and m.version != 3 for m in backend.fleet.members.values())  # never a wrong weight
            await backend.load_weights(str(root / "v4"), 4)  # the next full version: the retry takes it
            for s in servers:
                assert await held_by(backend, s, 4) == digests[4]
            await backend.load_weights(str(root / "v5"), 5)
            return [await held_by(backend, s, 5) for s in servers]
        finally:
            await backend.close()
            for s in servers:
                await s.stop()

    assert asyncio.run(go()) == [digests[5]] * 2
