"""``streamrl bench gateway``: what the gateway adds to each call of an agent, against the same
calls made to the fleet directly.

An OpenAI-compatible completions server runs in this process (vLLM's token-id fields; it answers
a fixed number of tokens at once, no model behind it, so what is measured is the gateway's own
work: the HTTP hop, rendering the conversation to tokens, recording each token's log-prob and
version, the journal). ``--episodes`` agents at once each make ``--turns`` calls, growing their
conversation each turn, in two variants alternated round by round: ``direct`` (each call a
``POST /v1/completions`` of the conversation's tokens to the server) and ``gateway`` (each call a
``POST /episodes/<id>/v1/chat/completions`` of the conversation's messages; every episode ended,
so its trajectory is published to the broker: that time is reported apart). Figures: calls per
second and median latency per call of each, their ratio, and the milliseconds added per call.
A third variant, ``fleet_client``, makes the direct calls through streamrl's fleet client
(``OpenAIBackend``, which the gateway itself calls the servers with): the gateway's own share
of the added time is the difference between it and ``gateway``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

from streamrl.bench import harness

HELP = "gateway calls/s and added latency per call against the fleet called directly (one run)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, quick="a short run (under a minute)",
                                 out="where gateway.json goes (default runs/bench)")
    parser.add_argument("--episodes", type=int, default=16, help="agents at once (default 16)")
    parser.add_argument("--turns", type=int, default=0, help="calls per episode (default 8; --quick 4)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 3; --quick 1)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens the server answers per call (default 32)")


class FixedServer:
    """``POST /v1/completions``: ``tokens`` token ids with log-probs, at once."""

    def __init__(self, tokens: int):
        from aiohttp import web

        self.tokens, self.calls = tokens, 0
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)

    async def completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.calls += 1
        ids = [(97 + (self.calls + i) % 26) for i in range(self.tokens)]
        prompt = body["prompt"] if isinstance(body["prompt"], list) else []
        return web.json_response({"id": "c", "object": "text_completion", "model": body.get("model", ""), "choices": [{
            "index": 0, "text": "".join(chr(t) for t in ids), "finish_reason": "length", "token_ids": ids,
            "prompt_token_ids": prompt, "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                                     "token_logprobs": [-1.0] * len(ids)}}]})


async def _direct(http: Any, url: str, episodes: int, turns: int, lat: list[float]) -> None:
    async def one(e: int) -> None:
        context = [1 + (e + i) % 200 for i in range(40)]
        for _ in range(turns):
            t0 = time.perf_counter()
            async with http.post(f"{url}/v1/completions", json={
                    "model": "m", "prompt": context, "max_tokens": 32, "logprobs": 0, "return_token_ids": True,
                    "return_tokens_as_token_ids": True}) as r:
                out = await r.json()
            lat.append(time.perf_counter() - t0)
            context = context + out["choices"][0]["token_ids"] + [2, 3, 4, 5]
    await asyncio.gather(*(one(e) for e in range(episodes)))


async def _fleet_client(backend: Any, episodes: int, turns: int, lat: list[float]) -> None:
    """As ``_direct``, through streamrl's fleet client (``OpenAIBackend``: what the gateway and a
    rollout worker call the servers with)."""
    from streamrl.rollout.backends import SamplingParams

    async def one(e: int) -> None:
        context = [1 + (e + i) % 200 for i in range(40)]
        for _ in range(turns):
            t0 = time.perf_counter()
            [[c]] = await backend.generate([context], 1, SamplingParams(max_new_tokens=32))
            lat.append(time.perf_counter() - t0)
            context = context + list(c.response_ids) + [2, 3, 4, 5]
    await asyncio.gather(*(one(e) for e in range(episodes)))


async def _gateway(http: Any, base: str, episodes: int, turns: int, lat: list[float], ends: list[float]) -> None:
    async def one(e: int) -> None:
        eid = f"b{uuid.uuid4().hex[:10]}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"agent {e}: " + "x" * 30}]
        for i in range(turns):
            t0 = time.perf_counter()
            async with http.post(f"{base}/episodes/{eid}/v1/chat/completions",
                                 json={"model": "m", "messages": messages, "max_tokens": 32}) as r:
                out = await r.json()
            lat.append(time.perf_counter() - t0)
            messages = messages + [out["choices"][0]["message"], {"role": "user", "content": f"turn {i}"}]
        t0 = time.perf_counter()
        async with http.post(f"{base}/episodes/{eid}/end", json={"reward": 1.0}) as r:
            assert r.status == 200, await r.text()
        ends.append(time.perf_counter() - t0)
    await asyncio.gather(*(one(e) for e in range(episodes)))


class GatewayBench(harness.Bench):
    name = "gateway"
    broker = True
    variants = ("direct", "fleet_client", "gateway")

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.rounds = args.rounds or (1 if args.quick else 3)
        self.turns = args.turns or (4 if args.quick else 8)
        self.episodes = args.episodes
        print(f"bench gateway: {self.episodes} agents x {self.turns} calls, {args.tokens} tokens per answer, "
              f"{self.rounds} rounds", file=sys.stderr, flush=True)

    @contextlib.asynccontextmanager
    async def session(self) -> Any:
        """The completions server, a gateway in front of it (journalling, on fresh topics), and
        one HTTP client for every call."""
        import aiohttp
        from aiohttp import web

        from streamrl.bus import Bus
        from streamrl.rollout.backends.openai_server import OpenAIBackend
        from streamrl.rollout.config import GatewayConfig, OpenAIBackendConfig, RolloutConfig
        from streamrl.rollout.gateway import Gateway
        from streamrl.topics import ensure_topics

        server = FixedServer(self.args.tokens)
        runner = web.AppRunner(server.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        bus = Bus(dataclasses.replace(self.bus, topic_prefix=f"bench{uuid.uuid4().hex[:8]}"))
        await ensure_topics(bus)
        with tempfile.TemporaryDirectory(prefix="streamrl-bench-gateway-") as journal:
            cfg = RolloutConfig(backend="openai", openai=OpenAIBackendConfig(model="m"), max_new_tokens=self.args.tokens,
                                follow_policy=False,
                                gateway=GatewayConfig(port=0, state_dir=journal))
            gateway = Gateway(bus, cfg, backend=OpenAIBackend(f"{self.url}/v1", "m", max_retries=1))
            self.backend = OpenAIBackend(f"{self.url}/v1", "m", max_retries=1)
            task = asyncio.create_task(gateway.run())
            while gateway.port is None and not task.done():
                await asyncio.sleep(0.05)
            self.base = f"http://127.0.0.1:{gateway.port}"
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as self.http:
                try:
                    yield
                finally:
                    await self.backend.close()
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await runner.cleanup()

    async def measure(self, variant: str, round: int) -> dict[str, float]:
        lat: list[float] = []
        ends: list[float] = []
        t0 = time.perf_counter()
        if variant == "direct":
            await _direct(self.http, self.url, self.episodes, self.turns, lat)
        elif variant == "fleet_client":
            await _fleet_client(self.backend, self.episodes, self.turns, lat)
        else:
            await _gateway(self.http, self.base, self.episodes, self.turns, lat, ends)
        took = time.perf_counter() - t0 - sum(ends) / max(1, self.episodes)  # the end calls apart
        out = {"calls_per_s": len(lat) / took, "p50_ms": statistics.median(lat) * 1000,
               "mean_ms": statistics.fmean(lat) * 1000}
        if ends:
            out["end_p50_ms"] = statistics.median(ends) * 1000
        self.note(f"round {round + 1}/{self.rounds} {variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()))
        return out

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        d, f, g = runs.medians("direct"), runs.medians("fleet_client"), runs.medians("gateway")
        return {"episodes": self.episodes, "turns": self.turns, "tokens_per_answer": self.args.tokens,
                "rounds": self.rounds,
                "direct_calls_per_s": round(d["calls_per_s"], 1), "fleet_client_calls_per_s": round(f["calls_per_s"], 1),
                "gateway_calls_per_s": round(g["calls_per_s"], 1),
                "ratio_gateway_to_fleet_client_calls_per_s": round(g["calls_per_s"] / f["calls_per_s"], 3),
                "fleet_client_p50_ms": round(f["p50_ms"], 2),
                "added_p50_ms_per_call_vs_fleet_client": round(g["p50_ms"] - f["p50_ms"], 2),
                "ratio_gateway_to_direct_calls_per_s": round(g["calls_per_s"] / d["calls_per_s"], 3),
                "direct_p50_ms": round(d["p50_ms"], 2), "gateway_p50_ms": round(g["p50_ms"], 2),
                "added_p50_ms_per_call": round(g["p50_ms"] - d["p50_ms"], 2),
                "ratio_gateway_to_direct_p50": round(g["p50_ms"] / d["p50_ms"], 3),
                "end_episode_p50_ms": round(g["end_p50_ms"], 2)}

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        s = summary
        print(f"direct {s['direct_calls_per_s']:.0f} calls/s, p50 {s['direct_p50_ms']} ms | fleet client "
              f"{s['fleet_client_calls_per_s']:.0f} calls/s, p50 {s['fleet_client_p50_ms']} ms | gateway "
              f"{s['gateway_calls_per_s']:.0f} calls/s ({s['ratio_gateway_to_direct_calls_per_s']}x), p50 "
              f"{s['gateway_p50_ms']} ms (+{s['added_p50_ms_per_call']} ms) | end of episode (published) p50 "
              f"{s['end_episode_p50_ms']} ms", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    return harness.run(GatewayBench(args))
