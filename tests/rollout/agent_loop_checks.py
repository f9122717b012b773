"""What the agent-loop and gateway tests share: the tiny policy with every engine call recorded,
and the exactness check of a trajectory against those calls (``tests/rollout/test_agent_loops.py``'s
module doc says what is checked)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from streamrl.records import Trajectory
from streamrl.rollout.backends import Completion
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from tests.helpers import recompute_logprobs

# the scripted turns carry the call's number, so no two episodes' tokens are the same
TOOL_CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "3+4+0*{n}"}}}}</tool_call>'


# -- the policy: the tiny model, every call recorded --------------------------------------------

class RecordingPolicy(TransformersBackend):
    """The tiny model. A context asking for a tool (``USE_TOOL``) gets a scripted tool call,
    then a scripted answer, with the model's own log-probs; any other context is sampled. Every
    call is recorded: (prompt ids, response ids, log-probs, version)."""

    def __init__(self) -> None:
        super().__init__("tiny", seed=0)
        self.calls: list[tuple[list[int], list[int], np.ndarray, int]] = []

    def _generate(self, prompts, n, params):
        tok, out = self.tokenizer, []
        for p in prompts:
            ids = list(p) if isinstance(p, list) else tok(p, add_special_tokens=False)["input_ids"]
            context = tok.decode(ids)
            if "USE_TOOL" in context:
                n_call = len(self.calls)
                text = TOOL_CALL.format(n=n_call) if "tool:" not in context else f"so ({n_call}) #### 7"
                resp = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                lps = recompute_logprobs(self.model, ids, resp, params.temperature or 1.0).astype(np.float32)
                samples = [Completion(text=text, prompt_ids=ids, response_ids=list(resp), response_logprobs=lps.copy(),
                                      finish_reason="stop", policy_version=0) for _ in range(n)]
            else:
                samples = super()._generate([ids], n, params)[0]
            for s in samples:
                self.calls.append((ids, list(s.response_ids), np.asarray(s.response_logprobs), self.version))
            out.append(samples)
        return out


@pytest.fixture(scope="module")
def policy() -> RecordingPolicy:
    torch.set_num_threads(1)
    return RecordingPolicy()


def check(t: Trajectory, calls: list[tuple[list[int], list[int], np.ndarray, int]], tok: Any) -> int:
    """The exactness checks of the module doc on ``t``; the number of engine calls it is made of."""
    prompt_ids, response = list(t.array("prompt_ids")), list(t.array("response_ids"))
    full, mask, lps = prompt_ids + response, t.array("response_mask"), t.array("response_logprobs")
    mine = sorted((c for c in calls if full[:len(c[0]) + len(c[1])] == c[0] + c[1]), key=lambda c: len(c[0]))
    assert mine and mine[0][0] == prompt_ids  # the first call saw the prompt, exactly
    sampled = [tok for c in mine for tok in c[1]]
    assert [r for r, m in zip(response, mask) if m] == sampled  # mask 1: the engine's tokens, all of them
    assert np.array_equal(lps[mask == 1], np.concatenate([c[2] for c in mine]))  # bit for bit
    assert not lps[mask == 0].any()
    expected = []  # each token's version: the call's that sampled it; a given token: the one before it
    pos = 0
    for c in mine:
        start = len(c[0]) - len(prompt_ids)
        expected += [expected[-1] if expected else c[3]] * (start - pos) + [c[3]] * len(c[1])
        pos = start + len(c[1])
    expected += [expected[-1]] * (len(response) - pos)
    assert list(t.versions().per_token()) == expected
    assert t.policy_version == min(c[3] for c in mine)
    return len(mine)
