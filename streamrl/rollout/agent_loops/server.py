"""The server manager an agent loop calls (verl's ``LLMServerClient.generate`` signature): each
call goes to the rollout worker's backend (the fleet of inference servers, or the in-process
engine), after the worker's ``before_turn`` (a newer policy version is loaded between calls, as
between the turns of streamrl's own multi-turn), and is recorded: the prompt, the sampled token
ids, their log-probs and the weights version of each token. The trajectory is built from that
record, never from what the loop says it was given, so every token trained on is one the policy
sampled, stamped with the weights that decoded it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from streamrl.errors import Failure
from streamrl.records import VersionRuns
from streamrl.rollout.agent_loops.base import TokenOutput
from streamrl.rollout.backends import Backend, BackendError, SamplingParams


@dataclass
class Call:
    """One ``generate`` call: what the policy was given and what it sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]
    versions: list[int]  # one per sampled token


@dataclass
class EpisodeServer:
    """One episode's server manager: ``generate`` as verl's, recording every call in ``calls``."""

    backend: Backend
    params: SamplingParams
    before_turn: Callable[[], Awaitable[None]] | None = None
    calls: list[Call] = field(default_factory=list)
    generation_s: float = 0.0

    async def generate(self, request_id: Any = None, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, mm_processor_output: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise Failure("agent_loop_error", "an agent loop sent images, video or audio: the rollout workers "
                                              "generate from text prompts only")
        params = self._params(sampling_params or {})
        if self.before_turn is not None:
            await self.before_turn()
        t0 = time.monotonic()
        [[c]] = await self.backend.generate([[int(t) for t in prompt_ids]], 1, params)
        self.generation_s += time.monotonic() - t0
        if c.response_ids is None or c.response_logprobs is None:
            raise BackendError("agent loops need the sampled token ids and log-probs; the backend returned text only "
                               "(rollout.openai.token_ids, or a server that reports them)")
        ids = [int(t) for t in c.response_ids]
        lps = [float(x) for x in np.asarray(c.response_logprobs, dtype=np.float32)]
        versions = [int(v) for v in c.version_runs().per_token()]
        stops = set(sampling_params.get("stop_token_ids") or ())
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))  # as the engine stops there
        ids, lps, versions = ids[:cut], lps[:cut], versions[:cut]
        self.calls.append(Call(list(prompt_ids), ids, lps, versions))
        stopped = cut < len(c.response_ids) or c.finish_reason == "stop"
        return TokenOutput(token_ids=list(ids), log_probs=list(lps), stop_reason="completed" if stopped else None)

    def _params(self, given: dict[str, Any]) -> SamplingParams:
        """verl's sampling params on the worker's: temperature, top_p and max_tokens read;
        top-k and a repetition penalty, which no backend here applies, refused unless off."""
        if given.get("top_k") not in (None, -1, 0):
            raise Failure("agent_loop_error", f"sampling_params top_k={given['top_k']!r}: top-k sampling is not "
                                              "available to agent loops here (-1: off)")
        if given.get("repetition_penalty") not in (None, 1, 1.0):
            raise Failure("agent_loop_error", f"sampling_params repetition_penalty={given['repetition_penalty']!r}: "
                                              "not available here (1.0: off)")
        out = dataclasses.replace(self.params, temperature=float(given.get("temperature", self.params.temperature)),
                                  top_p=float(given.get("top_p", self.params.top_p)))
        limit = given.get("max_tokens") or given.get("max_new_tokens")
        if limit:
            out = dataclasses.replace(out, max_new_tokens=min(int(limit), self.params.max_new_tokens))
        return out

    def stamp(self, response_ids: list[int], response_mask: list[int]) -> tuple[np.ndarray, VersionRuns]:
        """The behaviour log-probs and the token versions over a loop's response: each token
        under mask 1 is matched, in order, to a token the policy sampled in one of this episode's
        calls (its log-prob, its version); a token under mask 0 was given (log-prob 0, the version
        before it). A call whose tokens the loop dropped is skipped; a masked token the policy
        never sampled fails the prompt."""
        if len(response_ids) != len(response_mask):
            raise Failure("agent_loop_error", f"response_ids ({len(response_ids)}) and response_mask "
                                              f"({len(response_mask)}) differ in length")
        lps = np.zeros(len(response_ids), dtype=np.float32)
        runs = VersionRuns([])
        c, o = 0, 0
        last = self.calls[0].versions[0] if self.calls and self.calls[0].versions else 0
        for i, (tok, m) in enumerate(zip(response_ids, response_mask)):
            if not m:
                runs.extend(last, 1)
                continue
            c, o = self._find(int(tok), c, o, i)
            call = self.calls[c]
            lps[i], last = call.log_probs[o], call.versions[o]
            runs.extend(last, 1)
            o += 1
        return lps, runs

    def _find(self, tok: int, c: int, o: int, i: int) -> tuple[int, int]:
        while c < len(self.calls):
            ids = self.calls[c].token_ids
            if o < len(ids) and ids[o] == tok:
                return c, o
            c, o = c + 1, 0
        raise Failure("agent_loop_tokens", f"response token {i} ({tok}) is under mask 1 but is not the next token the "
                                           "policy sampled in this episode's generate calls")
