"""Simulated costs for the benchmarks, where this machine has no GPU.

Everything here stands in for *time*, never for code: the stages under test are the real ones.

- ``serve_generation``: a real aiohttp server speaking the OpenAI completions API (what ``vllm
  serve`` speaks), answering each request after a fixed latency. A request carries one prompt
  and ``n`` samples, which a GPU engine generates together, so the latency is per trajectory
  and the ``n`` samples of a request share it. Answers are deterministic in (prompt, sample
  index), with token ids (bytes of the text, inside the tiny policy's vocabulary) and
  log-probs, so the learner can take them as they are.
- ``serve_tokens``: the same API with RL's length mix, a per-token cost, decoding slots and a
  weight load of fixed cost (``bench pipeline --on-update``: drain, abort, partial).
- ``serve_judge``: a real aiohttp server speaking the OpenAI chat API (what ``JudgeScorer``
  calls). Each answer waits a latency drawn from ``JudgeLatency``: fixed, or log-uniform
  between ``low`` and ``high`` (the long tail of remote LLM judges). The draw is a hash of the
  request body, so the same trajectory costs the same in every run that scores it: the
  synchronous and the streaming runs pay for the same work.
- ``serve_teacher``: a real aiohttp server speaking the OpenAI completions API with vLLM's
  ``prompt_logprobs`` (what the teacher stage's ``openai`` backend calls), answering each
  request (one record) after a fixed latency: the teacher's per-record cost.
- ``FollowingBackend``: the rollout worker's ``OpenAIBackend`` that takes the learner's
  versions (what pointing ``vllm serve`` at each new version does), so trajectories carry the
  version they were generated with and the staleness bounds are exercised for real.
- ``TimedTrainer``: the learner's real ``Trainer`` (its model is what the learner saves and
  announces each version) whose update costs a fixed time instead of CPU (see ``pipeline``), or
  a fixed time more than its real update (see ``learning``).
- ``latency_backend``, ``score_after``: the real generation and rule score, each answered a
  fixed latency later than its real work, or (generation) busy a fixed time more per decoding
  step (see ``learning``).
- ``Costs``: which of these a run's stages take, handed to the stage processes (``_stages``).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import math as _math
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any, Sequence

import orjson

from streamrl.rollout.backends import Completion, PromptInput, SamplingParams, make_backend
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.scorers.digits import compute_score
from streamrl.tasks.digits import OPS


@dataclass(frozen=True)
class JudgeLatency:
    """``low == high``: fixed. Otherwise log-uniform on ``[low, high]`` seconds: every decade
    equally likely, so most answers are quick and a few take up to ``high / low`` times longer."""

    low: float
    high: float

    @property
    def mean(self) -> float:
        if self.high <= self.low:
            return self.low
        return (self.high - self.low) / math.log(self.high / self.low)

    def draw(self, u: float) -> float:
        """The latency at quantile ``u`` in [0, 1)."""
        if self.high <= self.low:
            return self.low
        return self.low * (self.high / self.low) ** u


def unit(data: bytes) -> float:
    """A number in [0, 1) that depends only on ``data``."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") / 2.0 ** 64


# -- the servers (each in its own process) ------------------------------------------------------

def serve_generation(port_queue: Any, latency_s: float) -> None:
    """An OpenAI completions server; every request answers after ``latency_s``."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["prompt"]
        text_prompt = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        prompt_ids = list(prompt) if isinstance(prompt, list) else list(text_prompt.encode()[:1024])
        await asyncio.sleep(latency_s)
        choices = []
        for i in range(int(body.get("n", 1))):
            u = unit(f"{text_prompt}\x00{i}".encode())
            answer = int(u * 1000)
            text = f"Step by step, sample {i}: the total is {answer}.\n#### {answer}"
            ids = list(text.encode())
            choices.append({"index": i, "text": text, "finish_reason": "stop", "token_ids": ids,
                            "prompt_token_ids": prompt_ids,
                            "logprobs": {"token_logprobs": [-1.0] * len(ids)}})
        return web.json_response({"id": "sim", "object": "text_completion", "model": body.get("model", ""),
                                  "choices": choices})

    _serve(port_queue, [("POST", "/v1/completions", completions)])


def serve_tokens(port_queue: Any, token_s: float, load_s: float, slots: int, min_tokens: int,
                 max_tokens: int) -> None:
    """An OpenAI completions server with RL's length mix (``bench pipeline --on-update``): each
    response is log-uniform between ``min_tokens`` and ``max_tokens`` long (a hash of its
    prompt), ``slots`` requests decode at once at ``token_s`` per token each (continuous
    batching; more wait for a slot), streamed (``stream``: a chunk per ``TICK`` tokens) or
    whole, and ``POST /update_weights_from_disk`` takes ``load_s`` with nothing decoding.

    A prompt is text (``"prompt ..."``: its bytes are its token ids, all < 256) or token ids (a
    continuation: the prompt's ids, then the response's so far, all >= 256), so a continued
    response keeps its length. A client that goes away (an abort, or a partial rollout cut for
    an update) ends its request at the next tick; the tokens decoded and never delivered are
    ``lost``. ``POST /stats`` answers tokens decoded, lost, slot-seconds busy and the time
    (``{"reset": true}`` zeroes them)."""
    from aiohttp import web

    tick = 16
    latency = JudgeLatency(float(min_tokens), float(max_tokens))
    free = asyncio.Semaphore(slots)
    loading = asyncio.Event()
    loading.set()  # set: not loading
    stats = {"tokens": 0, "lost": 0, "busy_slot_s": 0.0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        ids = list(prompt.encode()) if isinstance(prompt, str) else [int(t) for t in prompt]
        original = [t for t in ids if t < 256]
        done = len(ids) - len(original)
        length = int(latency.draw(unit(bytes(original))))
        todo = max(0, min(int(body.get("max_tokens", 16)), length - done))
        stream = bool(body.get("stream"))
        resp: web.StreamResponse | None = None
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
        produced: list[int] = []
        await loading.wait()
        async with free:
            started = time.monotonic()
            try:
                while len(produced) < todo:
                    step = min(tick, todo - len(produced))
                    await asyncio.sleep(step * token_s)
                    new = [256 + (done + len(produced) + i) % 30000 for i in range(step)]
                    produced += new
                    stats["tokens"] += step
                    finished = len(produced) >= todo
                    reason = ("stop" if done + len(produced) >= length else "length") if finished else None
                    if resp is not None:
                        choice = {"index": 0, "text": "x" * step, "finish_reason": reason,
                                  "logprobs": {"tokens": [f"token_id:{t}" for t in new],
                                               "token_logprobs": [-1.0] * step}}
                        if len(produced) == step:  # the first chunk: the prompt's ids, as vLLM sends them
                            choice["prompt_token_ids"] = ids
                        try:
                            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
                        except (ConnectionError, RuntimeError):
                            stats["lost"] += step
                            return resp
                    elif request.transport is None or request.transport.is_closing():
                        stats["lost"] += len(produced)
                        return web.Response()
            except asyncio.CancelledError:
                stats["lost"] += len(produced) if resp is None else 0
                raise
            finally:
                stats["busy_slot_s"] += time.monotonic() - started
        if resp is not None:
            if not todo:
                await resp.write(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        reason = "stop" if done + len(produced) >= length else "length"
        return web.json_response({"choices": [{"index": 0, "text": "x" * len(produced), "finish_reason": reason,
                                               "token_ids": produced, "prompt_token_ids": ids,
                                               "logprobs": {"token_logprobs": [-1.0] * len(produced)}}]})

    async def load(request: web.Request) -> web.Response:
        loading.clear()
        try:
            await asyncio.sleep(load_s)
        finally:
            loading.set()
        return web.json_response({"success": True})

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    async def report(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("reset"):
            stats.update(tokens=0, lost=0, busy_slot_s=0.0)
        return web.json_response({**stats, "at": time.monotonic()})

    _serve(port_queue, [("POST", "/v1/completions", completions), ("POST", "/update_weights_from_disk", load),
                        ("GET", "/health", health), ("POST", "/stats", report)])


def serve_judge(port_queue: Any, low_s: float, high_s: float) -> None:
    """An OpenAI chat server answering "Score: N" after a ``JudgeLatency(low_s, high_s)`` draw."""
    from aiohttp import web

    latency = JudgeLatency(low_s, high_s)

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        u = unit(body)
        await asyncio.sleep(latency.draw(u))
        score = int(unit(body[::-1]) * 11)
        return web.json_response({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": f"The reasoning holds up in part.\nScore: {score}"}}],
            "usage": {"total_tokens": 120}})

    _serve(port_queue, [("POST", "/v1/chat/completions", chat)])


def serve_teacher(port_queue: Any, latency_s: float) -> None:
    """An OpenAI completions server answering vLLM's ``prompt_logprobs`` for the prompt's token
    ids after ``latency_s``: every position gets the prompt's own token (what vLLM always
    includes) and ``prompt_logprobs`` other ids, with deterministic log-probs."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt, k = [int(t) for t in body["prompt"]], int(body.get("prompt_logprobs") or 0)
        await asyncio.sleep(latency_s)
        entries: list[Any] = [None]
        for t in prompt[1:]:
            entry = {str(t): {"logprob": -0.5, "rank": 1}}
            others = [i for i in range(k + 1) if i != t][:k]
            entry.update({str(i): {"logprob": -1.0 - 0.1 * r, "rank": r + 2} for r, i in enumerate(others)})
            entries.append(entry)
        return web.json_response({"id": "sim", "object": "text_completion", "model": body.get("model", ""),
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                                               "prompt_logprobs": entries}]})

    _serve(port_queue, [("POST", "/v1/completions", completions)])


def serve_digits_teacher(port_queue: Any, tokenizer_dir: str, p_right: float = 0.97) -> None:
    """A rule-built teacher for the generated ``digits`` task (``streamrl.tasks.digits``: "rev
    48=" answered "84" and end-of-sequence), as an OpenAI completions server answering vLLM's
    ``prompt_logprobs``: after the prompt's "=", the teacher puts ``p_right`` on the right answer's
    next character (then on end-of-sequence) and the rest evenly on the other tokens; the sampled
    token's log-prob (``prompt_logprobs`` 0, the KL-estimator losses) is what it answers. A
    teacher that solves the task, without training one."""
    from aiohttp import web
    from transformers import AutoTokenizer


    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tok)
    right, wrong, idle = _math.log(p_right), _math.log((1 - p_right) / (vocab - 1)), -_math.log(vocab)

    def expected(text: str) -> list[str] | None:
        """The right response's tokens for a prompt "OP DIGITS=" (None: not the task's)."""
        head, eq, _ = text.partition("=")
        op, _, digits = head.rpartition(" ")
        op = op.split()[-1] if op.split() else ""
        if not eq or op not in OPS or not digits.isdigit():
            return None
        return list(OPS[op](digits)) + [tok.eos_token]

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        ids = [int(t) for t in body["prompt"]]
        pieces = [p.replace("\u0120", " ") for p in tok.convert_ids_to_tokens(ids)]  # byte-level space
        text = "".join(pieces)
        eq = text.find("=")
        answer = expected(text[:eq + 1]) if eq >= 0 else None
        k = int(body.get("prompt_logprobs") or 0)
        entries: list[Any] = [None]
        seen = 0
        for i, piece in enumerate(pieces):
            if i:
                j = seen - (eq + 1)  # the response position (pieces are single characters here)
                want = answer[j] if answer is not None and 0 <= j < len(answer) else None
                top = tok.convert_tokens_to_ids(want) if want is not None else None
                # the top k (top-k losses): the right token first, then others at the rest's share
                entry = {t: (right if t == top else wrong) if want is not None else idle
                         for t in ([top] if top is not None else []) + [t for t in range(k + 1) if t != top]}
                entry = dict(list(entry.items())[:max(k, 1)])
                entry[ids[i]] = (right if ids[i] == top else wrong) if want is not None else idle
                entries.append({str(t): {"logprob": lp, "rank": 1} for t, lp in entry.items()})
            seen += len(piece)
        return web.json_response({"choices": [{"index": 0, "text": "", "finish_reason": "length",
                                               "prompt_logprobs": entries}]})

    _serve(port_queue, [("POST", "/v1/completions", completions)])


def _serve(port_queue: Any, routes: list[tuple[str, str, Any]]) -> None:
    from aiohttp import web

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim", "object": "model"}]})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> None:
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)  # the routers' health checks (vLLM's route)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
        port_queue.put(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


class SimServer:
    """One of the servers above in a child process, for the duration of a ``with`` block."""

    def __init__(self, target: Any, *args: Any):
        ctx = mp.get_context("spawn")
        self._ports = ctx.Queue()
        self.process = ctx.Process(target=target, args=(self._ports, *args), daemon=True)

    def __enter__(self) -> "SimServer":
        self.process.start()
        self.port = self._ports.get(timeout=60)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.process.terminate()
        self.process.join(10)


# -- the stages' simulated parts ----------------------------------------------------------------

class FollowingBackend(OpenAIBackend):
    """``OpenAIBackend`` whose server follows the learner: loading a version is telling the
    server to serve it (instant here: the server simulates generation), and samples are stamped
    with the version in use when their request was sent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.can_load_weights = True  # the fleet underneath has no update API: this class follows

    async def load_weights(self, uri: str, version: int, base_uri: str | None = None) -> float:
        self.version = version
        return 0.0

    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        version = self.version
        out = await super().generate(prompts, n, params)
        for samples in out:
            for s in samples:
                s.policy_version = version
        return out


class TimedTrainer:
    """The real ``Trainer`` (model, tokenizer, optimizer state: what the learner saves and
    announces each version) whose step takes ``step_s`` longer than its real update (``real``:
    ``learning``'s fixed latencies), or ``step_s`` of wall time in all and no CPU, the gradient
    arithmetic left out (``pipeline``: on 2 shared cores a CPU step would compete with the stages)."""

    def __init__(self, trainer: Any, step_s: float, real: bool = True):
        self._trainer, self.step_s, self.real = trainer, step_s, real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def step(self, samples: Sequence[Any]) -> dict[str, float]:
        if self.real:
            out = self._trainer.step(samples)
            time.sleep(self.step_s)
            return out
        started = time.perf_counter()
        rewards = [float(s.reward) for s in samples]
        mean = sum(rewards) / max(1, len(rewards))
        std = (sum((r - mean) ** 2 for r in rewards) / max(1, len(rewards))) ** 0.5
        tokens = float(sum(s.n_tokens for s in samples))
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        return {"loss": 0.0, "pg_loss": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "ppo_kl": 0.0,
                "is_weight": 1.0, "grad_norm": 0.0, "skipped_steps": 0.0, "tokens": tokens,
                "sequences": float(len(samples)), "reward_mean": mean, "reward_std": std,
                "step_seconds": time.perf_counter() - started}


def latency_backend(cfg: Any, latency_s: float, token_latency_s: float = 0.0) -> Any:
    """The rollout config's own backend (transformers, for the bench that trains for real), each
    ``generate`` call answered ``latency_s`` later than its real work; and (``token_latency_s``)
    each engine call busy ``token_latency_s`` longer per decoding step it took (its longest
    response), inside the engine: a weight load waits for it as for a GPU's decoding, so an
    update can land between two tokens of a response (``bench learning --on-update``)."""
    backend = make_backend(cfg)
    if token_latency_s:
        engine = backend._generate

        def decode(prompts: list[Any], n: int, params: Any) -> Any:
            out = engine(prompts, n, params)
            steps = max((len(s.response_ids or ()) for samples in out for s in samples), default=0)
            time.sleep(token_latency_s * steps)
            return out

        backend._generate = decode
    if latency_s:
        real = backend.generate

        async def generate(prompts: Sequence[Any], n: int, params: Any) -> Any:
            out = await real(prompts, n, params)
            await asyncio.sleep(latency_s)
            return out

        backend.generate = generate
    return backend


async def score_after(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                      latency_s: float = 0.0) -> dict[str, Any]:
    """The digits rule, answered after ``latency_s`` (a judge's round trip): a ``type: function``
    scorer entry."""
    if latency_s:
        await asyncio.sleep(latency_s)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


@dataclass(frozen=True)
class Costs:
    """What a run's generation and update cost, the same in the synchronous loop and in the stage
    processes (which get it pickled): ``following``, the rollout config's OpenAI server (a
    ``serve_generation`` that pays the latency itself) through ``FollowingBackend``; otherwise its
    own backend with ``gen_latency_s`` added to each call (and ``token_latency_s`` to each
    decoding step of its engine). ``fixed_step``: each update takes
    ``step_s`` in all and no CPU; otherwise the real update, then ``step_s`` more (``TimedTrainer``)."""

    gen_latency_s: float = 0.0
    step_s: float = 0.0
    following: bool = False
    fixed_step: bool = False
    token_latency_s: float = 0.0  # per decoding step of an in-process engine call (``latency_backend``)

    def backend(self, rollout: Any) -> Any:
        if self.following:
            o = rollout.openai
            return FollowingBackend(o.base_url, o.model, api_key_env="", timeout_s=o.timeout_s,
                                    max_retries=o.max_retries)
        return latency_backend(rollout, self.gen_latency_s, self.token_latency_s)

    def trainer(self, trainer: Any) -> Any:
        return TimedTrainer(trainer, self.step_s, real=not self.fixed_step)
