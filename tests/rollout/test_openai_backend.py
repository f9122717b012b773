"""The OpenAI-compatible backend against a real aiohttp server in the test process that speaks
``/v1/completions`` and samples from the tiny transformers model (as ``vllm serve`` would);
then a rollout worker that rides out the server being down."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch

from streamrl import metrics
from streamrl.records import DeadLetter, Prompt, Trajectory
from streamrl.rollout.backends import BackendError, BackendUnavailable, SamplingParams
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from streamrl.rollout.config import OpenAIBackendConfig, RolloutConfig
from streamrl.rollout.worker import RolloutWorker
from tests.helpers import read_topic, recompute_logprobs
from tests.rollout.completions_server import CompletionsServer, start_server

KEY = "sk-test-7d1f0c"


@pytest.fixture(scope="module")
def engine() -> TransformersBackend:
    torch.set_num_threads(1)
    return TransformersBackend("tiny", seed=0)


def test_completions_with_token_ids_logprobs_and_key(engine, monkeypatch, caplog):
    monkeypatch.setenv("TEST_OPENAI_KEY", KEY)
    caplog.set_level(logging.DEBUG)

    async def go():
        server = CompletionsServer(engine)
        runner, url = await start_server(server)
        backend = OpenAIBackend(url, "tiny-policy", api_key_env="TEST_OPENAI_KEY", max_retries=2)
        try:
            params = SamplingParams(max_new_tokens=12, temperature=0.8)
            out = await backend.generate(["What is 2+2?", [10, 20, 30]], 3, params)
            server.fail_next = [503, 502]  # two transient failures, then it answers
            (again,) = await backend.generate(["hi"], 1, params)
            server.fail_next = [503, 503, 503]  # more than max_retries: unavailable, not faked
            with pytest.raises(BackendUnavailable):
                await backend.generate(["hi"], 1, params)
            server.fail_next = []
            with pytest.raises(BackendError, match="HTTP 400"):
                await backend.generate(["hi"], 1, SamplingParams(max_new_tokens=100))
            return server, out, again
        finally:
            await backend.close()
            await runner.cleanup()

    server, out, again = asyncio.run(go())
    assert len(out) == 2 and all(len(group) == 3 for group in out)
    assert server.requests[0]["n"] == 3 and server.requests[0]["logprobs"] == 0
    assert all(h.get("Authorization") == f"Bearer {KEY}" for h in server.headers)
    tok = engine.tokenizer
    for prompt, group in zip(["What is 2+2?", [10, 20, 30]], out):
        for s in group:
            assert s.prompt_ids == (prompt if isinstance(prompt, list) else tok(prompt)["input_ids"])
            assert len(s.response_ids) == len(s.response_logprobs) <= 12
            assert s.response_logprobs.dtype == np.float32
            assert tok.decode(s.response_ids, skip_special_tokens=True) == s.text
            np.testing.assert_allclose(s.response_logprobs, recompute_logprobs(engine.model, s.prompt_ids, s.response_ids, 0.8),
                                       atol=2e-4)
    assert len(again) == 1 and again[0].text is not None
    assert KEY not in caplog.text


def test_ignore_eos_generates_past_the_end_of_sequence_in_process_and_on_a_server():
    """verl's rollout.ignore_eos: with the end-of-sequence token made the likeliest (a bias on the
    real model's logits), a response stops at it; with ignore_eos it runs to max_new_tokens, its
    EOS tokens kept, in process (transformers) and through an OpenAI-compatible server (the
    request's ignore_eos, which vLLM's server honours as the test server does)."""
    torch.set_num_threads(1)
    engine = TransformersBackend("tiny", seed=0)
    eos = engine.tokenizer.eos_token_id
    bias = torch.zeros(engine.model.config.vocab_size)
    bias[eos] = 8.0
    engine.model.lm_head.register_forward_hook(lambda module, args, out: out + bias)

    async def go(ignore_eos: bool):
        server = CompletionsServer(engine)
        runner, url = await start_server(server)
        backend = OpenAIBackend(url, "tiny-policy", api_key_env="")
        params = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=ignore_eos)
        try:
            local = await engine.generate(["hi", [10, 20]], 4, params)
            remote = await backend.generate(["hi"], 4, params)
            return server, [s for group in local + remote for s in group]
        finally:
            await backend.close()
            await runner.cleanup()

    _, stopped = asyncio.run(go(False))
    assert all(s.finish_reason == "stop" and len(s.response_ids) < 10 and s.response_ids[-1] == eos for s in stopped)
    server, full = asyncio.run(go(True))
    assert server.requests[0]["ignore_eos"] is True
    assert all(s.finish_reason == "length" and len(s.response_ids) == len(s.response_logprobs) == 10 for s in full)
    assert sum(s.response_ids.count(eos) for s in full) > len(full)  # EOS sampled, and generation went on

def test_the_worker_samples_with_rollout_ignore_eos(memory_bus):
    """``rollout.ignore_eos`` reaches the sampling parameters of every generation of a worker."""
    for value in (False, True):
        cfg = RolloutConfig(backend="openai", ignore_eos=value,
                            openai=OpenAIBackendConfig(base_url="http://127.0.0.1:9/v1", model="m", api_key_env=""))
        assert RolloutWorker(memory_bus, cfg).params.ignore_eos is value


def test_text_only_server_gives_text_only_samples(engine):
    async def go():
        server = CompletionsServer(engine)
        runner, url = await start_server(server)
        backend = OpenAIBackend(url, "tiny-policy", api_key_env="", token_ids=False)
        try:
            return server, await backend.generate(["hello"], 2, SamplingParams(max_new_tokens=6))
        finally:
            await backend.close()
            await runner.cleanup()

    server, ((a, b),) = asyncio.run(go())
    assert "return_token_ids" not in server.requests[0] and "Authorization" not in server.headers[0]
    assert a.response_ids is None and a.prompt_ids is None and len(a.response_logprobs) > 0


def test_worker_holds_prompts_while_the_server_is_down(engine, memory_bus):
    bus = memory_bus  # the worker's logic; the server is real HTTP
    seen = {}

    async def go():
        # the server is down when the worker starts; it comes up a few seconds later
        server = CompletionsServer(engine)
        probe, url = await start_server(server)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        await probe.cleanup()
        cfg = RolloutConfig(backend="openai", max_new_tokens=6, group_size=2, max_in_flight=2,
                            openai=OpenAIBackendConfig(base_url=url, model="tiny-policy", max_retries=0, api_key_env=""))
        worker = RolloutWorker(bus, cfg)
        down_before = metrics.ROLLOUT_BACKEND_UNAVAILABLE.labels("openai")._value.get()
        task = asyncio.create_task(worker.run())
        producer = bus.producer("test")
        await producer.start()
        prompts = [Prompt(group_id=f"g{i}", group_size=2, data_source="gsm8k", prompt=f"{i} + {i} =",
                          ground_truth=str(2 * i)) for i in range(3)]
        for p in prompts:
            await producer.send_and_wait(p)
        refused = Prompt(group_id="refused", group_size=2, data_source="gsm8k", prompt="REFUSE this")
        await producer.send_and_wait(refused)
        await producer.stop()
        while metrics.ROLLOUT_BACKEND_UNAVAILABLE.labels("openai")._value.get() < down_before + 2:
            await asyncio.sleep(0.2)
        runner, _ = await start_server(server, port)
        try:
            messages = await read_topic(bus, "rollouts", 6, timeout_s=40)
            seen["letters"] = await read_topic(bus, "deadletter", 1, timeout_s=20)
        finally:
            worker.stop()
            await task
            await runner.cleanup()
        seen["down"] = metrics.ROLLOUT_BACKEND_UNAVAILABLE.labels("openai")._value.get() - down_before
        return [Trajectory.decode(m.value) for m in messages]

    trajs = asyncio.run(go())
    assert len(trajs) == 6 and seen["down"] >= 2
    assert sorted(t.id for t in trajs) == sorted(f"g{i}-{k}" for i in range(3) for k in range(2))
    assert all(t.policy_version == 0 and t.array("response_ids") is not None for t in trajs)
    # a prompt the server refuses for good is dead-lettered with the server's reason, not retried
    (letter,) = [DeadLetter.decode(m.value) for m in seen["letters"]]
    assert letter.reason == "backend_error" and "prompt is too long" in letter.detail
    assert Prompt.decode(letter.original_value()).group_id == "refused"
