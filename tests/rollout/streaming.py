"""Completion servers for the rollout tests that stream (server-sent events, as vLLM and SGLang
do), whose weights are a version number: the token after a context is a function of the
context's length and the version, with log-prob ``-(version + 1) / 10``, so a test knows
exactly which weights decoded each token after any prefix (``weights_of``).

``TokenServer`` runs in the test process, or as a process of its own (``python -m
tests.rollout.streaming``, ``TokenProcess``) that a test can freeze with SIGSTOP: a hung server
whose connections stay open, as a frozen machine's do. ``reply`` answers a completions request
as JSON or, when it asks for ``stream``, as one server-sent event per choice (the fakes that
answer whole responses)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from tests.helpers import AppServer

PROMPT = [11, 12, 13, 14]
LENGTH = 30  # every response is this many tokens (prompt tokens are < 100, response tokens >= 100)
STOP_AT = len(PROMPT) + LENGTH


def token(context_len: int, version: int) -> int:
    return 100 + (context_len * 7 + version * 1000) % 3000


def logprob(version: int) -> float:
    return -(version + 1) / 10


def expected(prefix: int, versions: list[tuple[int, int]]) -> tuple[list[int], list[float]]:
    """The tokens and log-probs after ``prefix`` tokens of context, run by run."""
    ids, lps, n = [], [], prefix
    for version, count in versions:
        for _ in range(count):
            ids.append(token(n, version))
            lps.append(logprob(version))
            n += 1
    return ids, lps


def weights_of(prefix: int, ids: list[int], lps: list[float], candidates: range) -> list[int | None]:
    """The version whose weights decoded each token (its id and its log-prob both that version's
    after the context before it), None where no candidate did: the trace a test checks every
    token's stamp against."""
    out: list[int | None] = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        found = [v for v in candidates if token(prefix + i, v) == t and abs(logprob(v) - lp) < 1e-6]
        out.append(found[0] if len(found) == 1 else None)
    return out


async def reply(request: web.Request, body: dict[str, Any], choices: list[dict[str, Any]]) -> web.StreamResponse:
    """A completions answer: JSON, or (``stream``) each choice as one event, then ``[DONE]``."""
    if not body.get("stream"):
        return web.json_response({"id": "cmpl", "object": "text_completion", "model": body.get("model"),
                                  "choices": choices})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for choice in choices:
        await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


class TokenServer(AppServer):
    """Completions at ``rate`` tokens per second, streamed or whole; weights = a version
    (``version``: the weights it starts on), responses of ``length`` tokens. ``requests``: each
    request's body and its arrival (monotonic) time."""

    def __init__(self, rate: float = 100.0, load_s: float = 0.05, version: int = 0, length: int = LENGTH):
        self.rate, self.load_s, self.version, self.length = rate, load_s, version, length
        self.requests: list[dict] = []
        self.arrivals: list[float] = []

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/update_weights_from_disk", self._load)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(self.load_s)
        self.version = int(re.search(r"v(\d+)$", body["model_path"]).group(1))
        return web.json_response({"success": True})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.arrivals.append(time.monotonic())
        prompt = body["prompt"]
        context = [b % 100 for b in prompt.encode()] if isinstance(prompt, str) else list(prompt)
        given = sum(1 for t in context if t < 100)  # the prompt's; the response's so far are >= 100
        version = self.version
        if not body.get("stream"):  # whole: n choices (the same tokens: the weights are deterministic)
            ids: list[int] = []
            while len(ids) < int(body["max_tokens"]) and len(context) + len(ids) - given < self.length:
                await asyncio.sleep(1 / self.rate)
                ids.append(token(len(context) + len(ids), version))
            assert self.version == version, "weights changed under a request"
            done = len(context) + len(ids) - given >= self.length
            choice = {"text": "".join(f"<{t}>" for t in ids), "finish_reason": "stop" if done else "length",
                      "token_ids": ids, "prompt_token_ids": context,
                      "logprobs": {"token_logprobs": [logprob(version)] * len(ids)}}
            return web.json_response({"choices": [{"index": i, **choice} for i in range(int(body.get("n", 1)))]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = True
        for _ in range(int(body["max_tokens"])):
            await asyncio.sleep(1 / self.rate)
            assert self.version == version, "weights changed under a request"
            t = token(len(context), version)
            context.append(t)
            done = len(context) - given >= self.length
            choice = {"index": 0, "text": f"<{t}>", "finish_reason": "stop" if done else None,
                      "logprobs": {"tokens": [f"token_id:{t}"], "token_logprobs": [logprob(version)]}}
            if first:
                choice["prompt_token_ids"] = context[:-1]
                first = False
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
            if done:
                break
        else:
            await resp.write(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp


class PausingServer(TokenServer):
    """``TokenServer`` with the pause/resume endpoints as documented: SGLang ``POST
    /pause_generation {"mode": "retract"}`` and ``/continue_generation``, vLLM ``POST
    /pause?mode=keep&clear_cache=true`` and ``/resume`` (its load ``/collective_rpc``). A paused
    server decodes nothing and its open streams wait; each token is computed on the weights
    loaded when it is decoded (the caches cleared at the pause: nothing of the old weights
    carries over). ``abort_on_pause``: a vLLM before the ``keep`` mode, whose pause aborts the
    requests in flight (``finish_reason: abort``). A load while a request decodes fails the test."""

    def __init__(self, rate: float = 100.0, load_s: float = 0.05, abort_on_pause: bool = False, version: int = 0):
        super().__init__(rate, load_s, version)
        self.running = asyncio.Event()
        self.running.set()
        self.abort_on_pause = abort_on_pause
        self.calls: list[str] = []  # the control calls, in order
        self.decoded: list[int] = []  # the version of every token decoded

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        for route in ("/pause_generation", "/continue_generation", "/pause", "/resume", "/collective_rpc"):
            app.router.add_post(route, self._control)

    async def _control(self, request: web.Request) -> web.Response:
        route = request.path
        self.calls.append(route + (f"?{request.query_string}" if request.query_string else ""))
        body = await request.json() if request.can_read_body else None
        if route in ("/pause_generation", "/pause"):
            assert (body == {"mode": "retract"}) if route == "/pause_generation" else \
                (request.query.get("mode") == "keep" and request.query.get("clear_cache") == "true")
            self.running.clear()
        elif route in ("/continue_generation", "/resume"):
            self.running.set()
        else:  # vLLM's load through streamrl's worker extension
            assert not self.running.is_set(), "weights loaded under running requests"
            await asyncio.sleep(self.load_s)
            self.version = int(re.search(r"v(\d+)$", body["args"][0]).group(1))
        return web.json_response({"success": True})

    async def _load(self, request: web.Request) -> web.Response:
        assert not self.running.is_set(), "weights loaded under running requests"
        return await super()._load(request)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        context = list(body["prompt"]) if isinstance(body["prompt"], list) else [1] * 4
        given = sum(1 for t in context if t < 100)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(body["max_tokens"])):
            await asyncio.sleep(1 / self.rate)
            if not self.running.is_set():
                if self.abort_on_pause:
                    await resp.write(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}\n\n')
                    break
                await self.running.wait()
            t = token(len(context), self.version)
            self.decoded.append(self.version)
            context.append(t)
            done = len(context) - given >= LENGTH
            choice = {"index": 0, "text": f"<{t}>", "finish_reason": "stop" if done else None,
                      "logprobs": {"tokens": [f"token_id:{t}"], "token_logprobs": [logprob(self.version)]}}
            if i == 0:
                choice["prompt_token_ids"] = context[:-1]
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
            if done:
                break
        await resp.write(b"data: [DONE]\n\n")
        return resp


class TokenProcess:
    """A ``TokenServer`` in a process of its own (a real one: SIGSTOP freezes it whole, its
    connections left open, as a hung machine's are)."""

    def __init__(self, rate: float, length: int, version: int = 0):
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.rollout.streaming", "--rate", str(rate),
                                      "--length", str(length), "--version", str(version)],
                                     cwd=root, env=env, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "PORT <n>" once it listens
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"token server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.thaw()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--version", type=int, default=0)
    args = parser.parse_args()

    async def serve() -> None:
        server = await TokenServer(rate=args.rate, version=args.version, length=args.length).start()
        print(f"PORT {server.url.rsplit(':', 1)[1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
