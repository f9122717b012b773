"""A rewarded record as the trainer's sample: checked (reward bounds, group status, token
arrays against the vocabulary and each other) so that a record the update cannot use fails
alone, as a ``RecordError`` naming why, before it is in a mini-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.records import RecordError, Rewarded
from streamrl.reward.bounds import check_reward

if TYPE_CHECKING:
    from streamrl.learner.config import LearnerConfig


@dataclass
class Sample:
    """One trajectory ready to train on."""

    id: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    reward: float
    policy_version: int
    behaviour_logprobs: np.ndarray | None = None  # None: recompute with the current weights
    response_mask: np.ndarray | None = None  # 1 where the policy produced the token
    # distillation: the teacher's log-probs, one per response token (teacher_topk 0) or
    # teacher_topk per token row-major with their ids (records.Distilled)
    teacher_logprobs: np.ndarray | None = None
    teacher_ids: np.ndarray | None = None
    teacher_topk: int = 0
    teacher_name: str = ""  # several teachers (distillation.teacher_models): the one that annotated it
    reward_components: list[float] | None = None  # GDPO: gdpo_reward_keys' values from reward_info
    reward_baseline: float | None = None  # ReMax: the reward of the group's greedy response
    # learner.router_replay R3: the rollout's routing, [rows, layers, topk] over the first rows
    # tokens of prompt + response (streamrl.routing); None: routed by the learner itself
    routed_experts: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(len(self.response_ids) if self.response_mask is None else self.response_mask.sum())


def to_sample(record: Rewarded, cfg: "LearnerConfig", vocab: int, tokenizer: Any,
              route_shape: tuple[int, int, int] | None = None) -> Sample:
    """The record as a training sample, or ``RecordError`` saying why it cannot be one.
    ``vocab``: the policy's vocabulary size; ``tokenizer``: for text-only records
    (``learner.missing_logprobs: recompute``); ``route_shape``: the policy's ``(layers, topk,
    experts)`` where its routing is replayed (``learner.router_replay``)."""
    check_reward(record.reward, cfg.max_abs_reward, "learner.max_abs_reward", error=RecordError)
    group = (record.reward_info or {}).get("group")
    if (cfg.incomplete_groups == "drop" and isinstance(group, dict)
            and group.get("status") in ("incomplete", "late")):
        raise RecordError("incomplete_group", f"the group hook did not adjust it ({group.get('status')}); "
                          "learner.incomplete_groups is 'drop'")
    recompute = cfg.missing_logprobs == "recompute"
    prompt_ids, response_ids = record.array("prompt_ids"), record.array("response_ids")
    if prompt_ids is None or response_ids is None:
        if not recompute:
            raise RecordError("no_tokens", "prompt_ids/response_ids missing and "
                              "learner.missing_logprobs is 'error'")
        prompt_ids, response_ids = tokenize(record, tokenizer)
    logprobs = record.array("response_logprobs")
    if logprobs is None and not recompute:
        raise RecordError("no_logprobs", "response_logprobs missing and "
                          "learner.missing_logprobs is 'error'")
    mask = record.array("response_mask")
    n = len(response_ids)
    if cfg.max_response_tokens and n > cfg.max_response_tokens:
        raise RecordError("response_too_long", f"{n} response tokens, learner.max_response_tokens "
                          f"is {cfg.max_response_tokens}")
    if len(prompt_ids) == 0:
        raise RecordError("bad_tokens", "empty prompt_ids")
    if logprobs is not None and len(logprobs) != n:
        raise RecordError("bad_tokens", f"{len(logprobs)} response_logprobs for {n} response_ids")
    if mask is not None and len(mask) != n:
        raise RecordError("bad_tokens", f"{len(mask)} response_mask entries for {n} response_ids")
    for name, ids in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise RecordError("bad_tokens", f"{name} outside the vocabulary (size {vocab})")
    if logprobs is not None and not np.isfinite(logprobs).all():
        raise RecordError("bad_tokens", "response_logprobs has NaN or infinities")
    check_versions(record, n)
    sample = Sample(id=record.id, group_id=record.group_id, prompt_ids=prompt_ids,
                    response_ids=response_ids, reward=float(record.reward),
                    policy_version=record.policy_version, behaviour_logprobs=logprobs,
                    response_mask=mask, reward_components=reward_components(record, cfg))
    if cfg.distillation.enabled:
        teacher_arrays(sample, record, cfg, vocab)
    if cfg.router_replay == "R3" and record.routed_experts is not None:
        sample.routed_experts = rollout_routes(record, len(prompt_ids) + n, route_shape)
    return sample


def rollout_routes(record: Rewarded, tokens: int, shape: tuple[int, int, int] | None) -> np.ndarray:
    """The record's routed experts (R3), checked against its tokens (a row per token fed, at most
    ``tokens - 1``) and the policy's ``(layers, topk, experts)``; ``RecordError("bad_routing")``
    otherwise: replaying another model's routing would train on what neither computed."""
    from streamrl.routing import RoutingError, unpack

    try:
        routes = unpack(record.array("routed_experts"), record.routed_experts_shape)
    except (RoutingError, RecordError) as exc:
        raise RecordError("bad_routing", str(exc)) from None
    if len(routes) > tokens - 1:
        raise RecordError("bad_routing", f"routed_experts has {len(routes)} rows for {tokens} tokens (at most "
                          f"{tokens - 1}: the last sampled token is never fed)")
    if shape is not None:
        layers, topk, experts = shape
        if routes.shape[1:] != (layers, topk) or (routes.size and int(routes.max()) >= experts):
            raise RecordError("bad_routing", f"routed_experts of {routes.shape[1]} layers x top-{routes.shape[2]} "
                              f"(ids up to {int(routes.max()) if routes.size else 0}); the policy has {layers} x "
                              f"top-{topk} of {experts} experts")
    return routes


def teacher_arrays(sample: Sample, record: Rewarded, cfg: "LearnerConfig", vocab: int) -> None:
    """The teacher's annotation (``records.Distilled``) onto ``sample``, checked against the
    loss's needs: one log-prob per response token for the KL estimators, ``topk`` per token and
    their ids for ``forward_kl_topk``; ``RecordError("no_teacher" / "bad_teacher")`` otherwise."""
    loss = cfg.distillation.distillation_loss
    k = loss.topk if loss.use_topk else 0
    if (getattr(record, "teacher", None) or {}).get("unserved"):
        return  # no teacher serves its data source (teacher.unserved: train): trained without distillation
    logprobs = record.array("teacher_logprobs") if hasattr(record, "teacher_logprobs") else None
    if logprobs is None:
        raise RecordError("no_teacher", "no teacher_logprobs and distillation.enabled (is the teacher stage running, "
                                        "and the learner reading its topic?)")
    topk, n = int(getattr(record, "teacher_topk", 0)), len(sample.response_ids)
    if topk != k:
        raise RecordError("bad_teacher", f"teacher_topk {topk}, the loss {loss.loss_mode} needs {k}")
    if len(logprobs) != n * max(k, 1) or not np.isfinite(logprobs).all():
        raise RecordError("bad_teacher", f"{len(logprobs)} teacher_logprobs for {n} response tokens (top-{k}), "
                                         "or not finite")
    sample.teacher_logprobs, sample.teacher_topk = logprobs, k
    sample.teacher_name = str((getattr(record, "teacher", None) or {}).get("name") or "")
    if k:
        ids = record.array("teacher_ids")
        if ids is None or len(ids) != n * k or (len(ids) and (ids.min() < 0 or ids.max() >= vocab)):
            raise RecordError("bad_teacher", f"teacher_ids missing, of the wrong length, or outside the vocabulary "
                                             f"(size {vocab})")
        sample.teacher_ids = ids


def reward_components(record: Rewarded, cfg: "LearnerConfig") -> list[float] | None:
    """GDPO's components (``learner.gdpo_reward_keys``) from the record's ``reward_info``, where a
    scorer's dict result puts its fields; ``RecordError`` when one is missing or not a number."""
    if cfg.adv_estimator != "gdpo":
        return None
    info = record.reward_info or {}
    out = []
    for key in cfg.gdpo_reward_keys:
        value = info.get(key)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not np.isfinite(value):
            raise RecordError("no_reward_component", f"reward_info[{key!r}] is {value!r}: adv_estimator gdpo needs "
                              "a number (a scorer returning a dict with that field)")
        out.append(float(value))
    return out


def to_samples(records: list[Rewarded], cfg: "LearnerConfig", trainer: Any) -> list[Sample]:
    """Records as ``trainer``'s samples, by the learner's own conversion and checks: the
    synchronous loops of ``streamrl bench`` train exactly what the learner stage would."""
    vocab = trainer.model.get_input_embeddings().num_embeddings
    return [to_sample(r, cfg, vocab, trainer.tokenizer, trainer.route_shape) for r in records]


def tokenize(record: Rewarded, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """Token ids for a text-only record (``missing_logprobs: recompute``): the prompt as the
    chat template renders it (plain lines without one), the response as text."""
    tok = tokenizer
    if isinstance(record.prompt, str):
        prompt = tok(record.prompt, add_special_tokens=False).input_ids
    elif getattr(tok, "chat_template", None):
        prompt = tok.apply_chat_template(record.prompt, add_generation_prompt=True, tokenize=True)
    else:
        prompt = tok("\n".join(str(m.get("content") or "") for m in record.prompt),
                     add_special_tokens=False).input_ids
    response = tok(record.response, add_special_tokens=False).input_ids
    return np.asarray(prompt, dtype=np.int64), np.asarray(response, dtype=np.int64)


def check_versions(record: Rewarded, n_tokens: int) -> None:
    """A partial rollout's ``token_versions`` must cover its ``n_tokens`` response tokens, and its
    oldest run must be the ``policy_version`` every staleness bound counts: a record whose
    versions say otherwise would be trained under a bound it does not meet. (The behaviour
    log-probs are per token already: each is its own version's, whatever the runs say.)"""
    if not record.token_versions:
        return
    runs = record.versions()
    if runs.n_tokens != n_tokens:
        raise RecordError("bad_tokens", f"token_versions cover {runs.n_tokens} tokens, the response has {n_tokens}")
    if runs.oldest != record.policy_version:
        raise RecordError("bad_tokens", f"policy_version {record.policy_version} is not the oldest token's "
                          f"version ({runs.oldest})")
