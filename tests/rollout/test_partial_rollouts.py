"""Partial rollouts (``rollout.on_update: partial``): a response in flight when new weights load
is continued on them from its partial response, and every token carries the version that
produced it (``token_versions``) with its behaviour log-prob under those weights.

The server is a real aiohttp server in the test speaking the OpenAI completions API, streamed
(server-sent events, as vLLM and SGLang stream) and SGLang's ``/update_weights_from_disk``
(``tests.rollout.streaming``). It produces tokens at a fixed rate and its weights are a version
number: the token after a context is a function of the context's length and the version, with
log-prob ``-(version + 1) / 10``, so a test knows exactly which tokens each version gives after
any prefix.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

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
from tests.helpers import read_topic
from tests.rollout.streaming import LENGTH, PROMPT, STOP_AT, PausingServer, TokenServer, expected, weights_of

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
            await backend.use_starting_weights(0)  # the servers' starting weights are version 0
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


def test_an_update_mid_response_continues_it_on_the_new_weights(tmp_path):
    async def go():
        server = await TokenServer(rate=100).start()
        backend = OpenAIBackend("", "policy", servers=[server.url], update_api="sglang", on_update="partial",
                                health_interval_s=0)
        try:
            await backend.use_starting_weights(0)
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


def partial_fleet(url: str, weights: Path) -> RolloutConfig:
    """A worker on one SGLang-style server, groups of 2, ``on_update: partial``, weights under ``weights``."""
    return RolloutConfig(backend="openai", group_size=2, on_update="partial", servers=[url],
                         weights_prefixes=[str(weights)],
                         openai=OpenAIBackendConfig(model="policy", api_key_env="", update_api="sglang",
                                                    health_interval_s=0))


def test_the_rollout_worker_publishes_each_tokens_version(memory_bus, tmp_path):
    """The worker on a server fleet with ``on_update: partial``: a version announced while a
    group generates is loaded at once (not at the next prompt), and the group's records carry
    the versions of their tokens, oldest as ``policy_version``."""
    bus = memory_bus

    async def go():
        server = await TokenServer(rate=20).start()  # 1.5 s a response: the update lands inside it
        cfg = partial_fleet(server.url, tmp_path)
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


STARTING = -1  # the weights the servers start on: not version 0's


@pytest.mark.parametrize("api", ["sglang", "vllm", "no-pause"])
def test_servers_on_other_starting_weights_stamp_no_token_with_a_version_it_is_not(tmp_path, api):
    """Issue 57: servers started on weights that are not the announced version 0 (here -1),
    requests sent before any announcement, then v0 announced (a path: loaded) and v1 while they
    stream, under ``partial`` with SGLang's and vLLM's pause/resume and with none (cut and
    continued). Every token is traced to the weights that decoded it (its id and log-prob are
    those weights' after its context): each is stamped with exactly that version, the runs
    cover every token, and nothing was decoded on the starting weights."""
    async def go():
        servers = [await (PausingServer(rate=100, version=STARTING) if api != "no-pause" else
                          TokenServer(rate=100, version=STARTING)).start() for _ in range(2)]
        backend = OpenAIBackend("", "policy", servers=[s.url for s in servers], update_api=api.replace("no-pause", "sglang"),
                                on_update="partial", health_interval_s=0)
        try:
            request = asyncio.create_task(backend.generate([PROMPT], 4, SamplingParams(max_new_tokens=64)))
            await asyncio.sleep(0.3)
            sent_before = sum(len(s.requests) for s in servers)  # nothing on weights no announcement named
            await backend.load_weights(str(tmp_path / "v0"), 0)
            # every sample under way (a server that finished loading first may take all four)
            while sum(len(s.requests) for s in servers) < 4:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # ~10 tokens of v0 in
            await backend.load_weights(str(tmp_path / "v1"), 1)
            (group,) = await request
            return group, servers, sent_before
        finally:
            await backend.close()
            for s in servers:
                await s.stop()

    group, servers, sent_before = asyncio.run(go())
    assert sent_before == 0
    checked = 0
    for s in group:
        runs = s.version_runs()
        assert sum(n for _, n in runs.runs) == len(s.response_ids) == LENGTH  # the runs cover every token
        stamped = runs.per_token().tolist()
        traced = weights_of(len(PROMPT), s.response_ids, s.response_logprobs.tolist(), range(STARTING, 2))
        assert traced == stamped, (s.token_versions, traced)
        assert stamped[0] == 0 and stamped[-1] == 1 and s.policy_version == 0
        checked += len(stamped)
    assert checked == 4 * LENGTH
    for server in servers:
        if isinstance(server, PausingServer):
            assert STARTING not in server.decoded and server.decoded == sorted(server.decoded)


def test_the_worker_sends_nothing_until_version_0_is_announced_and_loaded(memory_bus, tmp_path):
    """The rollout stage up before the learner has announced anything, its servers on other
    starting weights: a prompt waits (no request) until version 0 is announced and loaded,
    and every token of its records is stamped with the weights that decoded it (v0, then v1
    announced mid-response)."""
    bus = memory_bus

    async def go():
        server = await PausingServer(rate=40, version=STARTING).start()
        cfg = partial_fleet(server.url, tmp_path)
        worker = RolloutWorker(bus, cfg)
        producer = bus.producer("learner")
        await producer.start()
        task = asyncio.create_task(worker.run())
        try:
            await producer.send_and_wait(Prompt(group_id="g0", group_size=2, data_source="gsm8k", prompt="1 + 1 =",
                                                ground_truth="2"))
            await asyncio.sleep(1.0)
            before = len(server.requests)
            await producer.send_and_wait(PolicyVersion(version=0, weights_uri=str(tmp_path / "v0")))
            while not server.requests:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            await producer.send_and_wait(PolicyVersion(version=1, weights_uri=str(tmp_path / "v1")))
            records = [Trajectory.decode(m.value) for m in await read_topic(bus, "rollouts", 2, timeout_s=30)]
            return records, before, server
        finally:
            await producer.stop()
            worker.stop()
            await task
            await server.stop()

    records, before, server = asyncio.run(go())
    assert before == 0 and STARTING not in server.decoded
    for r in records:
        prompt_ids = r.array("prompt_ids").tolist()
        stamped = r.versions().per_token().tolist()
        traced = weights_of(len(prompt_ids), r.array("response_ids").tolist(),
                            r.array("response_logprobs").tolist(), range(STARTING, 2))
        assert traced == stamped and len(stamped) == LENGTH and stamped[0] == 0 and stamped[-1] == 1
