"""Multi-turn episodes with the GSM8K feedback interaction on the tiny transformers model:
transcript, turn scores, response mask, turn limits, and log-probs that match the model on
exactly the tokens it sampled."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from streamrl.chat import ChatRenderer
from streamrl.config import ConfigError
from streamrl.policy import load_policy
from streamrl.weights import save_policy
from streamrl.records import Prompt, Trajectory
from streamrl.rollout.backends import SamplingParams
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from streamrl.rollout.episode import run_group
from streamrl.rollout.multiturn import InteractionRunner
from streamrl.rollout.interactions import BaseInteraction, load_interaction
from streamrl.rollout.interactions.gsm8k import CORRECT, INCORRECT, Gsm8kInteraction
from tests.helpers import recompute_logprobs

PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)
QUESTION = [{"role": "user", "content": "Tom has 3 apples and buys 4. How many? Let's think step by step "
                                        "and output the final answer after \"####\"."}]


class StopOnSecondTurn(BaseInteraction):
    """A user that gives up after two answers (loaded by dotted path, as a verl class is)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.seen: dict[str, int] = {}

    async def start_interaction(self, instance_id=None, **kwargs):
        instance_id = await super().start_interaction(instance_id)
        self.seen[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.seen[instance_id] += 1
        n = self.seen[instance_id]
        return n >= 2, f"try again ({self.config['tone']})", 0.25 * n, {"round": n}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self.seen[instance_id]


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    torch.set_num_threads(1)
    return TransformersBackend("tiny", seed=0)


def prompt(truth: str = "987654321") -> Prompt:
    return Prompt(group_id="g1", group_size=2, data_source="gsm8k", prompt=QUESTION, ground_truth=truth,
                  extra_info={"index": 3})


def test_gsm8k_interaction_says_right_or_wrong():
    async def go():
        it = Gsm8kInteraction({"name": "gsm8k"})
        iid = await it.start_interaction(ground_truth="7")
        wrong = await it.generate_response(iid, QUESTION + [{"role": "assistant", "content": "3 + 4 = 8\n#### 8"}])
        right = await it.generate_response(iid, QUESTION + [{"role": "assistant", "content": "3 + 4 = 7. #### 7"}])
        await it.finalize_interaction(iid)
        return wrong, right, it._instances

    wrong, right, left = asyncio.run(go())
    assert wrong == (False, INCORRECT, 0.0, {})
    assert right == (True, CORRECT, 1.0, {})
    assert left == {}


def test_gsm8k_feedback_loop_transcript_scores_and_mask(backend):
    runner = InteractionRunner(load_interaction("gsm8k"), "gsm8k", max_assistant_turns=3, max_user_turns=2)
    trajs = asyncio.run(run_group(prompt(), 2, backend, PARAMS, ChatRenderer(backend.tokenizer), runner))
    tok = backend.tokenizer
    assert len(trajs) == 2 and len({t.id for t in trajs}) == 2
    for t in trajs:
        # the random tiny model never gets 987654321 right: three answers, two feedback turns
        assert [m["role"] for m in t.turns] == ["assistant", "user", "assistant", "user", "assistant"]
        assert t.turns[1]["content"] == INCORRECT and t.turns[3]["content"] == INCORRECT
        assert t.response == t.turns[-1]["content"]
        assert t.extra_info["turn_scores"] == [0.0, 0.0, 0.0] and t.extra_info["num_turns"] == 3
        assert t.extra_info["interaction"] == "gsm8k" and t.extra_info["index"] == 3
        ids, mask, lps = t.array("response_ids"), t.array("response_mask"), t.array("response_logprobs")
        assert len(ids) == len(mask) == len(lps)
        # mask: 1-runs are the answers (<= max_new_tokens each), 0-runs the rendered feedback
        runs, start = [], 0
        for k in range(1, len(mask) + 1):
            if k == len(mask) or mask[k] != mask[start]:
                runs.append((int(mask[start]), start, k))
                start = k
        assert [r[0] for r in runs] == [1, 0, 1, 0, 1]
        for value, a, b in runs:
            if value == 1:
                assert b - a <= PARAMS.max_new_tokens
            else:
                assert tok.decode(ids[a:b]) == f"\nuser: {INCORRECT}\nassistant: "
                assert np.all(lps[a:b] == 0)
        answers = [tok.decode(ids[a:b], skip_special_tokens=True) for v, a, b in runs if v == 1]
        assert answers == [m["content"] for m in t.turns if m["role"] == "assistant"]
        # log-probs of the sampled tokens are the model's, in the context it really had
        want = recompute_logprobs(backend.model, t.array("prompt_ids"), ids, PARAMS.temperature)
        np.testing.assert_allclose(lps[mask == 1], want[mask == 1], atol=2e-4)
        assert tok.decode(t.array("prompt_ids")) == "user: " + QUESTION[0]["content"] + "\nassistant: "
        assert t.timings["generation_s"] > 0 and "interaction_s" in t.timings
        Trajectory.decode(t.encode())  # the record passes the topic's schema


def test_turn_limits_and_a_custom_interaction_by_dotted_path(backend):
    renderer = ChatRenderer(backend.tokenizer)
    one_user_turn = InteractionRunner(load_interaction("gsm8k"), "gsm8k", max_assistant_turns=5, max_user_turns=1)
    (t,) = asyncio.run(run_group(prompt(), 1, backend, PARAMS, renderer, one_user_turn))
    assert [m["role"] for m in t.turns] == ["assistant", "user", "assistant"]

    custom = load_interaction("tests.rollout.test_interactions.StopOnSecondTurn", {"tone": "kind"})
    runner = InteractionRunner(custom, "stop2", max_assistant_turns=4, max_user_turns=4)
    trajs = asyncio.run(run_group(prompt(), 2, backend, PARAMS, renderer, runner))
    for t in trajs:
        assert [m["role"] for m in t.turns] == ["assistant", "user", "assistant"]
        assert t.turns[1]["content"] == "try again (kind)"
        assert t.extra_info["turn_scores"] == [0.25, 0.5]
        assert t.extra_info["turn_info"] == [{"round": 1}, {"round": 2}]
    assert custom.seen == {}  # every episode finalized

    with pytest.raises(ConfigError, match="rollout.interaction.name"):
        load_interaction("no_such_interaction")
    with pytest.raises(ConfigError, match="cannot load"):
        load_interaction("streamrl.rollout.interactions.NoSuchClass")


def test_a_version_change_inside_an_episode_stamps_the_oldest(tmp_path):
    backend = TransformersBackend("tiny", seed=0)
    model, tok = load_policy("tiny", seed=1)  # different weights: "version 1"
    save_policy(model, tok, tmp_path / "v1")
    turns = []

    async def before_turn():
        turns.append(backend.version)
        if len(turns) == 2:
            await backend.load_weights(str(tmp_path / "v1"), 1)

    runner = InteractionRunner(load_interaction("gsm8k"), "gsm8k", max_assistant_turns=2, max_user_turns=1)
    (t,) = asyncio.run(run_group(prompt(), 1, backend, PARAMS, ChatRenderer(tok), runner, before_turn))
    assert backend.version == 1 and t.policy_version == 0
    # the second answer was sampled by the new weights: its log-probs are version 1's
    ids, mask, lps = t.array("response_ids"), t.array("response_mask"), t.array("response_logprobs")
    second = np.zeros(len(mask), bool)
    second[np.flatnonzero(mask == 0)[-1] + 1:] = True
    want = recompute_logprobs(model, t.array("prompt_ids"), ids, PARAMS.temperature)
    np.testing.assert_allclose(lps[second], want[second], atol=2e-4)
    assert not np.allclose(lps[mask == 1][:3], want[mask == 1][:3], atol=1e-3)


def test_greedy_sampling_is_deterministic_with_untempered_logprobs(backend):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    ids = backend.tokenizer("2 + 2 =")["input_ids"]
    (a,), (b,) = asyncio.run(backend.generate([ids], 1, greedy)), asyncio.run(backend.generate([ids], 1, greedy))
    a, b = a[0], b[0]
    assert a.response_ids == b.response_ids and len(a.response_ids) == 10 and a.finish_reason == "length"
    want = recompute_logprobs(backend.model, np.asarray(ids), np.asarray(a.response_ids), 1.0)
    np.testing.assert_allclose(a.response_logprobs, want, atol=2e-4)


def test_concurrent_requests_share_one_engine_call(backend):
    prompts = [backend.tokenizer(t)["input_ids"] for t in ("1 + 1 =", "a much longer prompt: 7 * 6 =", "x")]

    async def go():
        before = backend.batches
        out = await asyncio.gather(*(backend.generate([p], 3, PARAMS) for p in prompts),
                                   backend.generate([prompts[0]], 1, PARAMS))  # another n: its own call
        return out, backend.batches - before

    out, calls = asyncio.run(go())
    assert calls == 2
    for p, (group,) in zip(prompts, out[:3]):
        assert len(group) == 3
        for s in group:  # left-padded together, each sample is still its own prompt's
            assert s.prompt_ids == p
            want = recompute_logprobs(backend.model, np.asarray(p), np.asarray(s.response_ids), PARAMS.temperature)
            np.testing.assert_allclose(s.response_logprobs, want, atol=2e-4)
    assert len(out[3][0]) == 1


def test_chat_template_feedback_turns_extend_the_context_exactly():
    from streamrl.policy import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    r = ChatRenderer(tok)
    q = [{"role": "user", "content": "q"}]
    assert r.prompt_text(q) == "<|user|>\nq<eos>\n<|assistant|>\n"
    # the answer's own end-of-sequence token is not repeated; a cut-off answer gets one
    assert r.feedback_text(q, "A", "F", stopped=True) == "\n<|user|>\nF<eos>\n<|assistant|>\n"
    assert r.feedback_text(q, "A", "F", stopped=False) == "<eos>\n<|user|>\nF<eos>\n<|assistant|>\n"
    context = r.prompt_text(q) + "A<eos>" + r.feedback_text(q, "A", "F", stopped=True)
    assert context == tok.apply_chat_template(q + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "F"}],
                                              add_generation_prompt=True, tokenize=False)
