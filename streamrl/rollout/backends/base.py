"""The interface every generation backend implements: ``SamplingParams`` in, ``n`` samples per
prompt out, and the three ways a request can fail (refused for good, unavailable for now, a
version whose weights cannot be loaded)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from streamrl.weights import WeightLoadError  # noqa: F401 - raised here and by every backend

if TYPE_CHECKING:
    from streamrl.records import VersionRuns

PromptInput = str | list[int]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    # verl's rollout.ignore_eos: generation goes on past an end-of-sequence token to
    # max_new_tokens (the EOS tokens stay in the response, as vLLM's ignore_eos)
    ignore_eos: bool = False


@dataclass
class Completion:
    """One sampled response. Token fields are None when the backend cannot report them (a
    text-only server). (``learner.samples.Sample`` is the training sample made of a record.)"""

    text: str
    prompt_ids: list[int] | None
    response_ids: list[int] | None
    response_logprobs: np.ndarray | None  # float32, one per response token
    finish_reason: str  # "stop" (end of sequence) | "length" (max_new_tokens)
    policy_version: int  # the weights that produced it (the oldest, when it was continued on newer ones)
    # on_update partial: runs of (version, n_tokens) over its tokens; None: all policy_version's
    token_versions: list[tuple[int, int]] | None = None
    # MoE router replay (``rollout.return_routed_experts``): the experts each fed token was routed
    # to, ``[len(prompt_ids) + len(response_ids) - 1, layers, topk]`` (``streamrl.routing``)
    routed_experts: np.ndarray | None = None

    def version_runs(self) -> "VersionRuns":
        from streamrl.records import VersionRuns

        if self.token_versions:
            return VersionRuns(list(self.token_versions))
        n = len(self.response_ids) if self.response_ids is not None else (
            len(self.response_logprobs) if self.response_logprobs is not None else 0)
        return VersionRuns([(self.policy_version, n)])


class BackendError(Exception):
    """The backend refused this request for good (e.g. the prompt is too long): the prompt
    goes to dead letters with this message."""


class BackendUnavailable(Exception):
    """The backend cannot be reached right now (connection refused, 5xx, timeouts after
    retries): the worker holds the prompt and tries again; nothing is dropped or faked."""


class Backend(ABC):
    """What a rollout worker samples from."""

    name: str = "backend"
    tokenizer: Any = None  # a Hugging Face tokenizer, when the backend works on token ids
    can_load_weights: bool = True

    def __init__(self) -> None:
        self.version = 0  # the policy version of the weights in use

    @abstractmethod
    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        """``n`` samples for each prompt, in order."""

    async def load_weights(self, uri: str, version: int, base_uri: str | None = None) -> float:
        """Load a policy version between generations; returns the seconds it took. ``base_uri``:
        the version is a LoRA adapter (PEFT layout at ``uri``) on the base weights there."""
        raise WeightLoadError(f"the {self.name} backend cannot load weights")

    async def use_starting_weights(self, version: int) -> None:
        """The learner announced ``version`` with no weights to load: they are the ones this
        backend started with. A local engine is on them already; a server fleet serves nothing
        until an announcement names its servers' weights (``OpenAIBackend``)."""
        self.version = version

    def reseed(self, seed: int) -> None:
        """Seed the sampling from here on (an evaluation starts each version from the same seed,
        so its figure does not depend on what ran before). A server's backend cannot: no-op."""
        return None

    async def close(self) -> None:
        return None
