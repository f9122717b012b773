"""Partial rollouts (``rollout.on_update: partial``): a response in flight when new weights load
is continued on them from its partial response, and every token carries the version that
produced it (``token_versions``) with its behaviour log-prob under those weights.

The server is a real aiohttp server in the test speaking the OpenAI completions API, streamed
(server-sent events, as vLLM and SGLang stream) and SGLang's ``/update_weights_from_disk``. It
produces tokens at a fixed rate and its weights are a version number: the token after a context
is a function of the context's length and the version, with log-prob ``-(version + 1) / 10``,
so a test knows exactly which tokens each version gives after any prefix.
"""

from __future__ import annotations

import asyncio
import threading
import re

import numpy as np
import orjson
import pytest
import torch
from aiohttp import web

from streamrl.learner import losses
from streamrl.learner.config import LearnerConfig
from streamrl.learner.samples import to_sample
from streamrl.policy import load_policy
from streamrl.weights import save_policy
from streamrl.records import DeadLetter, PolicyVersion, Prompt, RecordError, Rewarded, Trajectory
from streamrl.rollout.backends import Backend, Completion, SamplingParams
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from streamrl.rollout.config import OpenAIBackendConfig, RolloutConfig
from streamrl.rollout.worker import RolloutWorker
from tests.helpers import AppServer, read_topic

PROMPT = [11, 12, 13, 14]
LENGTH = 30  # every response is this many tokens (prompt tokens are < 100, response tokens >= 100)
STOP_AT = len(PROMPT) + LENGTH


def token(context_len: int, version: int) -> int:
    return 100 + (context_len * 7 + version * 1000) % 3000


def logprob(version: int) -> float:
    return -(version + 1) / 10


class TokenServer(AppServer):
    """Completions at ``rate`` tokens per second, streamed or whole; weights = a version."""

    def __init__(self, rate: float = 100.0, load_s: float = 0.05):
        self.rate, self.load_s, self.version = rate, load_s, 0
        self.requests: list[dict] = []

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
        prompt = body["prompt"]
        context = [b % 100 for b in prompt.encode()] if isinstance(prompt, str) else list(prompt)
        given = sum(1 for t in context if t < 100)  # the prompt's; the response's so far are >= 100
        version = self.version
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = True
        for _ in range(int(body["max_tokens"])):
            await asyncio.sleep(1 / self.rate)
            assert self.version == version, "weights changed under a request"
            t = token(len(context), version)
            context.append(t)
            done = len(context) - given >= LENGTH
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

    def __init__(self, rate: float = 100.0, load_s: float = 0.05, abort_on_pause: bool = False):
        super().__init__(rate, load_s)
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


@pytest.mark.parametrize("api", ["sglang", "vllm", "vllm-aborting"])
def test_a_paused_update_resumes_the_requests_in_flight_on_the_new_weights(tmp_path, api):
    """``on_update: partial`` on a server with pause/resume: the fleet pauses the requests in
    flight, loads, resumes them: each stream stays open (no second request), the tokens before
    the update are v0's and those after v1's with their log-probs, exactly as the weights give
    them after that prefix. A vLLM whose pause aborts the requests (before its ``keep`` mode) is
    continued by new requests instead, with the same tokens."""
    aborting = api == "vllm-aborting"

    async def go():
        server = await PausingServer(rate=100, abort_on_pause=aborting).start()
        backend = OpenAIBackend("", "policy", servers=[server.url], update_api=api.split("-")[0],
                                on_update="partial", health_interval_s=0)
        try:
            request = asyncio.create_task(backend.generate([PROMPT], 2, SamplingParams(max_new_tokens=64)))
            await asyncio.sleep(0.12)  # ~10 tokens in
            await backend.load_weights(str(tmp_path / "v1"), 1)
            (group,) = await request
            return group, backend.fleet, server
        finally:
            await backend.close()
            await server.stop()

    group, fleet, server = asyncio.run(go())
    pause, resume = ("/pause_generation", "/continue_generation") if api == "sglang" else \
        ("/pause?mode=keep&clear_cache=true", "/resume")
    load = "/collective_rpc" if api != "sglang" else None
    assert server.calls == [pause, *([load] if load else []), resume] and server.version == 1
    assert fleet.paused == 1 and fleet.continued == (2 if aborting else 0)
    assert len(server.requests) == (4 if aborting else 2)  # one stream per sample (aborted: one more each)
    for s in group:
        assert s.finish_reason == "stop" and len(s.response_ids) == LENGTH and s.policy_version == 0
        (v0, before), (v1, after) = s.token_versions
        assert (v0, v1) == (0, 1) and before > 3 and after > 3
        ids, lps = expected(len(PROMPT), s.token_versions)
        assert s.response_ids == ids and s.prompt_ids == PROMPT
        np.testing.assert_allclose(s.response_logprobs, lps, rtol=1e-6)
    assert server.decoded == sorted(server.decoded)  # no token of v0 after one of v1: nothing decoded paused


def expected(prefix: int, versions: list[tuple[int, int]]) -> tuple[list[int], list[float]]:
    """The tokens and log-probs after ``prefix`` tokens of context, run by run."""
    ids, lps, n = [], [], prefix
    for version, count in versions:
        for _ in range(count):
            ids.append(token(n, version))
            lps.append(logprob(version))
            n += 1
    return ids, lps


def test_an_update_mid_response_continues_it_on_the_new_weights(tmp_path):
    async def go():
        server = await TokenServer(rate=100).start()
        backend = OpenAIBackend("", "policy", servers=[server.url], update_api="sglang", on_update="partial",
                                health_interval_s=0)
        try:
            request = asyncio.create_task(backend.generate([PROMPT], 2, SamplingParams(max_new_tokens=64)))
            await asyncio.sleep(0.12)  # ~10 tokens in
            await backend.load_weights(str(tmp_path / "v1"), 1)
            (group,) = await request
            # the same prefix continued on v1 without an update: what the continuation must equal
            cut = group[0].token_versions[0][1]
            (alone,) = await backend.generate([PROMPT + group[0].response_ids[:cut]], 1,
                                              SamplingParams(max_new_tokens=64))
            return group, alone[0], backend.fleet.continued, server
        finally:
            await backend.close()
            await server.stop()

    group, alone, continued, server = asyncio.run(go())
    # no pause endpoint here (404): the requests were cut and continued by new ones
    assert continued == 2 and server.version == 1
    for s in group:
        assert s.finish_reason == "stop" and len(s.response_ids) == STOP_AT - len(PROMPT)
        (v0, before), (v1, after) = s.token_versions
        assert (v0, v1) == (0, 1) and before > 3 and after > 3 and s.policy_version == 0
        ids, lps = expected(len(PROMPT), s.token_versions)
        assert s.response_ids == ids and s.prompt_ids == PROMPT
        np.testing.assert_allclose(s.response_logprobs, lps, rtol=1e-6)
    # exactly the tokens (and log-probs) a request on v1 alone gives after the same prefix
    assert alone.token_versions is None and alone.policy_version == 1
    assert group[0].response_ids[group[0].token_versions[0][1]:] == alone.response_ids
    # each continuation asked for what was left of the budget
    continuation = [r for r in server.requests if len(r["prompt"]) > len(PROMPT)][0]
    assert continuation["max_tokens"] == 64 - (len(continuation["prompt"]) - len(PROMPT))


def test_the_rollout_worker_publishes_each_tokens_version(memory_bus, tmp_path):
    """The worker on a server fleet with ``on_update: partial``: a version announced while a
    group generates is loaded at once (not at the next prompt), and the group's records carry
    the versions of their tokens, oldest as ``policy_version``."""
    bus = memory_bus

    async def go():
        server = await TokenServer(rate=20).start()  # 1.5 s a response: the update lands inside it
        cfg = RolloutConfig(backend="openai", group_size=2, on_update="partial", servers=[server.url],
                            weights_prefixes=[str(tmp_path)],
                            openai=OpenAIBackendConfig(model="policy", api_key_env="", update_api="sglang",
                                                       health_interval_s=0))
        worker = RolloutWorker(bus, cfg)
        producer = bus.producer("learner")
        await producer.start()
        await producer.send_and_wait(PolicyVersion(version=0, weights_uri=None))
        task = asyncio.create_task(worker.run())
        try:
            await producer.send_and_wait(Prompt(group_id="g0", group_size=2, data_source="gsm8k", prompt="1 + 1 =",
                                                ground_truth="2"))
            while not server.requests:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.15)
            await producer.send_and_wait(PolicyVersion(version=1, weights_uri=str(tmp_path / "v1")))
            return [Trajectory.decode(m.value) for m in await read_topic(bus, "rollouts", 2, timeout_s=30)]
        finally:
            await producer.stop()
            worker.stop()
            await task
            await server.stop()

    records = asyncio.run(go())
    for r in records:
        (v0, before), (v1, after) = r.token_versions
        assert (v0, v1) == (0, 1) and before + after == LENGTH and r.policy_version == 0
        ids, lps = expected(len(r.array("prompt_ids")), [(v0, before), (v1, after)])
        assert r.array("response_ids").tolist() == ids
        np.testing.assert_allclose(r.array("response_logprobs"), lps, rtol=1e-6)


def test_the_local_backend_continues_between_decoding_chunks(tmp_path):
    v1, tok = load_policy("tiny", seed=1)
    save_policy(v1, tok, tmp_path / "v1")
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)

    async def go():
        backend = TransformersBackend("tiny", seed=0)
        backend.partial_chunk = 4
        # the first chunk (on v0) holds until the load is queued behind it, whatever the load on
        # the machine: the load then runs between the first and the second chunk
        started, proceed, real = threading.Event(), threading.Event(), backend._generate

        def first_chunk_waits(*args, **kwargs):
            started.set()
            proceed.wait(10)
            return real(*args, **kwargs)

        backend._generate = first_chunk_waits
        request = asyncio.create_task(backend.generate(["1 + 1 ="], 1, greedy))
        await asyncio.to_thread(started.wait, 10)
        load = asyncio.create_task(backend.load_weights(str(tmp_path / "v1"), 1))
        await asyncio.sleep(0)  # the load's task runs first: it waits on the lock the chunk holds
        proceed.set()
        await load
        (group,) = await request
        s = group[0]
        k = 4  # the first chunk's tokens
        # the same on each version's weights alone: v0's first k tokens, v1's continuation of them
        reference = TransformersBackend("tiny", seed=0)
        (ref0,) = await reference.generate(["1 + 1 ="], 1, greedy)
        await reference.load_weights(str(tmp_path / "v1"), 1)
        (ref1,) = await reference.generate([s.prompt_ids + s.response_ids[:k]], 1,
                                           SamplingParams(max_new_tokens=12 - k, temperature=0.0))
        return s, k, ref0[0], ref1[0]

    s, k, ref0, ref1 = asyncio.run(go())
    assert s.token_versions == [(0, k), (1, len(s.response_ids) - k)] and s.policy_version == 0
    assert s.response_ids[:k] == ref0.response_ids[:k]
    assert s.response_ids[k:] == ref1.response_ids
    np.testing.assert_allclose(s.response_logprobs[:k], ref0.response_logprobs[:k], atol=1e-5)
    np.testing.assert_allclose(s.response_logprobs[k:], ref1.response_logprobs, atol=1e-5)


class SpanBackend(Backend):
    """Responses whose tokens span ``span`` versions (0, 1, ...), four tokens each."""

    name = "span"

    def __init__(self, span: int):
        super().__init__()
        self.span = span

    async def generate(self, prompts, n, params):
        runs = [(v, 4) for v in range(self.span)]
        return [[Completion(text="42", prompt_ids=[1, 2], response_ids=[5] * 4 * self.span,
                            response_logprobs=np.full(4 * self.span, -0.5, np.float32), finish_reason="stop",
                            policy_version=0, token_versions=runs if self.span > 1 else None)
                 for _ in range(n)] for _ in prompts]


@pytest.mark.parametrize("span", [2, 3])
def test_a_response_past_max_span_is_finished_but_dead_lettered_stale(memory_bus, span):
    bus = memory_bus
    cfg = RolloutConfig(group_size=2, max_span=2, follow_policy=False)

    async def go():
        worker = RolloutWorker(bus, cfg, backend=SpanBackend(span))
        producer = bus.producer("learner")
        await producer.start()
        task = asyncio.create_task(worker.run())
        try:
            await producer.send_and_wait(Prompt(group_id="g0", group_size=2, data_source="gsm8k", prompt="1 + 1 =",
                                                ground_truth="2"))
            topic = "rollouts" if span <= 2 else "deadletter"
            return [m.value for m in await read_topic(bus, topic, 2, timeout_s=20)]
        finally:
            await producer.stop()
            worker.stop()
            await task

    values = asyncio.run(go())
    if span <= 2:
        records = [Trajectory.decode(v) for v in values]
        assert all(r.token_versions == [[0, 4], [1, 4]] and r.policy_version == 0 for r in records)
        return
    letters = [DeadLetter.decode(v, 2**26) for v in values]
    assert all(d.stage == "rollout" and d.reason == "stale" and "span 3 policy versions" in d.detail
               for d in letters)
    kept = Trajectory.decode(letters[0].original_value())  # the whole trajectory, for replay
    assert kept.token_versions == [[0, 4], [1, 4], [2, 4]] and kept.id == letters[0].record_id


def rewarded(**fields) -> Rewarded:
    base = dict(group_id="g", group_size=1, policy_version=3, data_source="x", prompt="p", response="r",
                prompt_ids=[1, 2], response_ids=[5, 6, 7], response_logprobs=[-0.1, -0.2, -0.3], reward=1.0,
                scorer={"name": "rule"})
    return Rewarded.decode(Rewarded(**{**base, **fields}).encode())


def test_records_with_and_without_token_versions_train():
    cfg = LearnerConfig()
    old = to_sample(rewarded(), cfg, 100, None)  # a record of before partial rollouts
    assert old.policy_version == 3 and old.behaviour_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    new = to_sample(rewarded(token_versions=[[3, 1], [4, 2]]), cfg, 100, None)
    assert new.policy_version == 3
    with pytest.raises(RecordError, match="cover 2 tokens"):
        to_sample(rewarded(token_versions=[[3, 1], [4, 1]]), cfg, 100, None)
    with pytest.raises(RecordError, match="not the oldest"):
        to_sample(rewarded(token_versions=[[4, 3]]), cfg, 100, None)
    with pytest.raises(RecordError):  # the schema: pairs of versions and counts
        rewarded(token_versions=[[3]])


def test_each_tokens_own_behaviour_logprob_weights_it():
    """The decoupled objective's weight ``pi_prox / pi_behaviour`` is per token: the tokens a
    response got from an older version (a lower behaviour log-prob here) weigh differently
    from those of the newer one, in the same response."""
    prox = torch.tensor([[-0.2, -0.2, -0.2, -0.2]])
    behav = torch.tensor([[-0.5, -0.5, -0.2, -0.2]])  # runs [[v, 2], [v + 1, 2]]
    weight, _ = losses.importance_weight(prox, behav, torch.ones(1, 4), cap=10.0)
    assert weight[0, 0] == weight[0, 1] == pytest.approx(np.exp(0.3))
    assert weight[0, 2] == weight[0, 3] == pytest.approx(1.0)


def test_a_multi_turn_episode_cut_in_its_second_turn_stamps_each_token():
    """Turn 1 on v0, the user's feedback (given, mask 0), turn 2 started on v0 and continued on
    v1: every response token has its version, the feedback the version before it, and the
    trajectory is as old as its oldest token."""
    from streamrl.rollout.episode_state import EpisodeState
    from streamrl.rollout.multiturn import MultiTurn
    from streamrl.rollout.trajectory import build_trajectory

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [9] * len(text.split())}

    e = EpisodeState(index=0, messages=[{"role": "user", "content": "q"}], context=[1, 2], prompt_ids=[1, 2],
                     token_level=True)
    e.add_sample(Completion(text="a", prompt_ids=[1, 2], response_ids=[5, 6, 7], response_logprobs=[-0.1] * 3,
                            finish_reason="stop", policy_version=0))
    e.add_turn([({"role": "user", "content": "again"}, {"role": "user", "content": "again"})], "user: try again",
               Tok())
    e.add_sample(Completion(text="b", prompt_ids=None, response_ids=[8, 8, 8, 8], response_logprobs=[-0.2] * 4,
                            finish_reason="stop", policy_version=0, token_versions=[(0, 1), (1, 3)]))
    prompt = Prompt(group_id="g", group_size=1, data_source="gsm8k", prompt="q")
    t = build_trajectory(prompt, 1, e, 0.0, MultiTurn.from_config(RolloutConfig()))
    assert t.policy_version == 0
    assert t.token_versions == [[0, 3 + 3 + 1], [1, 3]]  # turn 1, the 3 feedback tokens, turn 2's first; then v1
    assert t.versions().per_token().tolist() == [0] * 7 + [1] * 3
    assert e.mask == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]


def test_the_learner_reports_span_and_worst_staleness_under_verls_names():
    from streamrl import metrics
    from streamrl.learner.metrics import mean_metrics, observe_staleness, record_figures
    from streamrl.tracking.trackers import train_figures

    old, spanning = rewarded(), rewarded(token_versions=[[3, 1], [5, 2]])
    figures = record_figures([old, spanning], version=6)
    assert figures["span_mean"] == 2.0 and figures["span_max"] == 3.0 and figures["staleness_worst"] == 3.0
    summary = mean_metrics([figures, {**figures, "staleness_worst": 1.0}])
    assert summary["staleness_worst"] == 3.0  # a version's worst mini-batch, not their mean
    named = train_figures(summary)
    assert named["streamrl/staleness/span_mean"] == 2.0 and named["streamrl/staleness/span_max"] == 3.0
    assert named["streamrl/staleness/worst"] == 3.0
    before = metrics.LEARNER_SPAN._sum.get()
    observe_staleness([old, spanning], version=6)
    assert metrics.LEARNER_SPAN._sum.get() - before == 1 + 3
    assert metrics.LEARNER_WORST_STALENESS._value.get() == 3
