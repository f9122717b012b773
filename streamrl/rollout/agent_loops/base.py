"""streamrl's own copy of verl's agent-loop API, with verl's names, for agent loops run without
verl (``verl.experimental.agent_loop``: ``AgentLoopBase``, ``register``, ``AgentLoopOutput``,
``AgentLoopMetrics``, the server manager's ``TokenOutput``).

A class written against verl's ``AgentLoopBase`` runs in a rollout worker unchanged when verl
imports; the same class written against this module runs where verl is not installed (verl's
agent loop imports Ray, Hydra and tensordict). The constructor takes what verl passes
(``trainer_config``, ``server_manager``, ``tokenizer``, ``processor``, ``dataset_cls``,
``data_config``, ``hf_model_type``, and any other keyword: ``tools``, the YAML entry's own keys),
and sets the same attributes (``config``, ``rollout_config``, ``server_manager``, ``tokenizer``,
``loop``...), so a loop reads ``self.rollout_config.response_length`` or
``self.rollout_config.multi_turn.max_user_turns`` as under verl.

The ``ct_*`` methods are verl's "continuous token" tokenization, text-only: the first prompt is
the chat template's rendering; a model turn appends exactly the sampled tokens (mask 1, their
log-probs); appended context messages (tool answers, a simulated user) are rendered as the
suffix the chat template adds for them (mask 0, log-prob 0). Multimodal inputs are refused.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class AgentLoopMetrics:
    """verl's per-episode timings (seconds) and preemptions."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


@dataclass(kw_only=True)
class AgentLoopOutput:
    """What an agent loop's ``run`` returns (verl's fields): ``response_ids`` hold the sampled
    tokens and the tokens the loop added (tool answers, a user's turn), ``response_mask`` is 1 on
    the sampled ones. ``reward_score`` set: the trajectory's reward (the reward group publishes
    it instead of scoring the trajectory, as verl's reward loop skips a sample with ``rm_scores``)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics | dict[str, Any] = field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_output: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.metrics, dict):
            known = {f.name for f in fields(AgentLoopMetrics)}
            self.metrics = AgentLoopMetrics(**{k: v for k, v in self.metrics.items() if k in known and v is not None})

    def model_dump(self) -> dict[str, Any]:  # pydantic's name, which verl's callers use
        return asdict(self)


@dataclass
class TokenOutput:
    """What the server manager's ``generate`` returns (verl's ``TokenOutput``): the sampled
    tokens and their log-probs."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


class DictConfigWrap:
    """verl's wrapper of a config handed to an agent loop (``.config``)."""

    def __init__(self, config: Any):
        self.config = config


class ToolListWrap:
    """verl's wrapper of the tool list handed to an agent loop (``.tools``)."""

    def __init__(self, tools: list):
        self.tools = tools


#: name -> {"_target_": "module.Class", ...}: what ``register`` and the agent-loop config add
_agent_loop_registry: dict[str, dict[str, Any]] = {}


def register(agent_name: str):
    """Register an agent-loop class under ``agent_name`` (verl's decorator)."""

    def decorator(subclass: type) -> type:
        _agent_loop_registry[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}"}
        return subclass

    return decorator


@dataclass(frozen=True)
class MergeResult:
    """The runtime token stream after a merge, and what was appended (verl's ``MergeResult``)."""

    token_ids: list[int]
    appended_token_count: int
    kind: str = "context"  # "assistant": sampled tokens | "context": given tokens
    inserted_token_ids: list[int] = field(default_factory=list)
    removed_prefix_token_count: int = 0


class AgentLoopBase(ABC):
    """An agent loop: takes a sample's messages, calls the policy through ``server_manager``
    (``await self.server_manager.generate(request_id=..., prompt_ids=..., sampling_params=...)``)
    and whatever environment it likes, and returns an ``AgentLoopOutput``. Constructed once per
    episode, as verl constructs it."""

    def __init__(self, trainer_config: DictConfigWrap, server_manager: Any, tokenizer: Any, processor: Any = None,
                 dataset_cls: Any = None, data_config: DictConfigWrap | None = None, hf_model_type: str | None = None,
                 **kwargs: Any):
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config.config if data_config is not None else {}
        self.apply_chat_template_kwargs = dict(self.data_config.get("apply_chat_template_kwargs", None) or {})
        self.mm_processor_kwargs = dict(self.data_config.get("mm_processor_kwargs", None) or {})
        self.hf_model_type = hf_model_type
        self.loop = asyncio.get_running_loop()

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One episode. ``sampling_params``: verl's (temperature, top_p, top_k, repetition_penalty,
        logprobs); ``kwargs``: the sample's fields (``raw_prompt``, ``data_source``,
        ``reward_model``, ``extra_info``, ``tools_kwargs``, ``interaction_kwargs``, ``index``,
        ``agent_name``)."""

    # -- multimodal: refused (the rollout workers read text prompts only) ------------------------

    def _assert_mm_supported(self, has_multi_modal: bool) -> None:
        if has_multi_modal:
            raise ValueError("multimodal inputs: streamrl's agent loops read text only")

    def _get_mm_processor_kwargs(self, audio_data: Any = None) -> dict[str, Any]:
        return dict(self.mm_processor_kwargs)

    async def process_vision_info(self, messages: list[dict]) -> dict:
        return {}

    async def process_multi_modal_info(self, messages: list[dict]) -> dict:
        return {}

    @staticmethod
    def build_sglang_video_payload(videos: Any, mm_inputs: dict[str, Any]) -> None:
        return None

    # -- continuous tokens ----------------------------------------------------------------------

    async def ct_build_initial_tokens(self, messages: list[dict], tools: list[dict] | None = None, images: Any = None,
                                      videos: Any = None, audios: Any = None, mm_inputs_out: Any = None) -> list[int]:
        self._assert_mm_supported(bool(images or videos or audios))
        ids = render_ids(self.tokenizer, messages, tools, self.apply_chat_template_kwargs)
        limit = self.rollout_config.get("prompt_length", None)
        if limit and len(ids) > limit:
            log.warning("prompt of %d tokens exceeds rollout.prompt_length=%d; left-truncating", len(ids), limit)
            ids = ids[-limit:]
        return ids

    async def ct_merge_assistant_token(self, runtime_token_ids: list[int], assistant_token_ids: list[int],
                                       response_mask: list[int], response_logprobs: list[float] | None = None,
                                       assistant_logprobs: list[float] | None = None
                                       ) -> tuple[MergeResult, list[int], list[float] | None]:
        result = MergeResult(token_ids=list(runtime_token_ids) + list(assistant_token_ids),
                             appended_token_count=len(assistant_token_ids), kind="assistant")
        return (result, *align_response_metadata(result, response_mask, response_logprobs, assistant_logprobs))

    async def ct_merge_context_msg(self, previous_messages: list[dict], updated_messages: list[dict],
                                   runtime_token_ids: list[int], response_mask: list[int],
                                   response_logprobs: list[float] | None = None, tools: list[dict] | None = None
                                   ) -> tuple[MergeResult, list[int], list[float] | None]:
        """Append ``updated_messages[len(previous_messages):]`` (tool answers, a user turn) as the
        tokens the chat template adds for them, after the end of the assistant turn when the
        sampled tokens did not close it, and the next generation prompt."""
        if updated_messages[:len(previous_messages)] != previous_messages:
            raise ValueError("agent loop messages must be append-only; earlier messages changed")
        new = updated_messages[len(previous_messages):]
        if not new:
            return MergeResult(list(runtime_token_ids), 0), list(response_mask), response_logprobs
        appended = context_ids(self.tokenizer, previous_messages, new, runtime_token_ids, tools)
        result = MergeResult(token_ids=list(runtime_token_ids) + appended, appended_token_count=len(appended))
        return (result, *align_response_metadata(result, response_mask, response_logprobs))

    def _cap_text_prompt_length(self, prompt_ids: list[int]) -> list[int]:
        limit = self.rollout_config.get("prompt_length", None)
        return prompt_ids[-limit:] if limit and len(prompt_ids) > limit else prompt_ids


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None,
               chat_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt's token ids: the chat template with the generation prompt (tools as
    ``ChatRenderer`` places them), or streamrl's plain ``role: content`` layout for a tokenizer
    without a template."""
    from streamrl.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    if renderer.template:
        extra = {"tools": tools} if tools and renderer.template_tools else {}
        text = tokenizer.apply_chat_template(renderer._with_tools(messages, tools), tokenize=False,
                                             add_generation_prompt=True, **extra, **(chat_kwargs or {}))
    else:
        text = renderer.prompt_text(messages, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def context_ids(tokenizer: Any, previous: list[dict[str, Any]], new: list[dict[str, Any]], runtime_ids: list[int],
                tools: list[dict] | None = None) -> list[int]:
    """The tokens that append messages ``new`` (tool answers, a user's turn) to a conversation
    whose tokens so far are ``runtime_ids`` and whose last message is the sampled assistant turn:
    the end of that turn if the policy did not sample it, the messages as the chat template
    renders them, and the next generation prompt (``ChatRenderer.turn_text``)."""
    from streamrl.chat import ChatRenderer

    last = previous[-1] if previous and previous[-1].get("role") == "assistant" else None
    before = previous[:-1] if last else list(previous)
    stopped = bool(runtime_ids) and runtime_ids[-1] == tokenizer.eos_token_id
    text = ChatRenderer(tokenizer).turn_text(before, (last or {}).get("content") or "", list(new), stopped=stopped,
                                             tools=tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def align_response_metadata(result: MergeResult, response_mask: list[int], response_logprobs: list[float] | None,
                            assistant_logprobs: list[float] | None = None) -> tuple[list[int], list[float] | None]:
    """The mask and log-probs extended over a merge: 1 and the sampled log-probs for assistant
    tokens, 0 and 0.0 for context tokens."""
    mask = list(response_mask)
    logprobs = list(response_logprobs) if response_logprobs is not None else None
    n = result.appended_token_count
    if result.kind == "assistant":
        mask += [1] * n
        if logprobs is not None:
            if assistant_logprobs is None or len(assistant_logprobs) != n:
                raise ValueError(f"{n} sampled tokens need as many log-probs")
            logprobs += list(assistant_logprobs)
    else:
        mask += [0] * n
        if logprobs is not None:
            logprobs += [0.0] * n
    return mask, logprobs
