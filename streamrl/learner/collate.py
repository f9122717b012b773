"""The tensors of one forward pass: a micro-batch's samples as token ids (padded, or packed end
to end in one row), the index of the logits that predict each response token, the tokens to
train on, and the teacher's log-probs under distillation.

Pure functions of the samples (and the device and model they go to): the trainer
(``streamrl.learner.trainer``) plans which samples make a micro-batch and runs the passes; the
objective (``streamrl.learner.objective``) reads the masks and the teacher's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from streamrl.learner.samples import Sample


@dataclass
class Batch:
    """One forward pass's tensors. Padded: ``input_ids`` ``[B, L]`` right-padded, ``positions``
    index each row. Packed (``packed`` set): ``input_ids`` ``[1, T]``, the B sequences end to end,
    ``positions`` index that one row. Log-probs come out ``[B, R]`` either way."""

    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded; packed: [1, T]
    attention_mask: torch.Tensor | None  # [B, L]; packed: None
    positions: torch.Tensor  # [B, R] index of the logits that predict response token j
    response_ids: torch.Tensor  # [B, R]
    mask: torch.Tensor  # [B, R] float: 1 for tokens to train on
    valid: torch.Tensor  # [B, R] bool: True for j < len(response)
    packed: dict[str, Any] | None = None  # packed: the forward's keywords (packing.forward_kwargs)
    teacher_logprobs: torch.Tensor | None = None  # distillation: [B, R], or [B, R, K] with teacher_ids
    teacher_ids: torch.Tensor | None = None  # forward_kl_topk: [B, R, K]
    student_topk: torch.Tensor | None = None  # set by each forward with teacher_ids: the student's [B, R, K]
    # distillation: [B, 1] 1 for a sample the teacher annotated, 0 for one no teacher serves
    # (teacher.unserved: train: its tokens add nothing to the distillation loss)
    teacher_served: torch.Tensor | None = None
    teacher_of: torch.Tensor | None = None  # several teachers: [B, 1] each sample's teacher's index (-1: none)
    # router replay (streamrl.routing): the experts each token the pass feeds is routed to,
    # [rows, layers, topk] in the routers' order (padded: B x L flattened; packed: T), and where
    # (route_mask [rows]); elsewhere the routers choose. None: no replay
    routes: torch.Tensor | None = None
    route_mask: torch.Tensor | None = None


def collate(samples: Sequence[Sample], device: torch.device, model: Any, pad_token_id: int | None,
            packed: bool = False, teacher_topk: int | None = None, teacher_names: Sequence[str] = ()) -> Batch:
    """The tensors of one forward pass (``packed``: one row without padding, ``model``'s
    keywords for it); ``teacher_topk`` (distillation): the teacher's log-probs too, ``0`` one per
    token, ``K`` the top-k ones with their ids, which samples a teacher served, and with several
    teachers (``teacher_names``) each sample's."""
    batch = collate_packed(samples, device, model) if packed else collate_padded(samples, device, pad_token_id)
    if teacher_topk is not None:
        batch.teacher_logprobs, batch.teacher_ids = teacher(samples, batch.mask.shape[1], teacher_topk, device)
        batch.teacher_served = torch.tensor([[float(s.teacher_logprobs is not None)] for s in samples], device=device)
        if teacher_names:
            batch.teacher_of = torch.tensor([[teacher_names.index(s.teacher_name) if s.teacher_name in teacher_names
                                              else -1] for s in samples], device=device)
    return batch


def routes(samples: Sequence[Sample], batch: Batch, layers: int, topk: int) -> None:
    """The samples' recorded routing (R3) onto ``batch`` in the order its routers see the tokens;
    left as None where no sample has any."""
    if all(s.routed_experts is None for s in samples):
        return
    packed = batch.packed is not None
    width = batch.input_ids.shape[1]
    out = torch.zeros((batch.input_ids.numel(), layers, topk), dtype=torch.long)
    mask = torch.zeros(batch.input_ids.numel(), dtype=torch.bool)
    start = 0
    for i, s in enumerate(samples):
        first = start if packed else i * width
        if s.routed_experts is not None:
            n = len(s.routed_experts)
            out[first:first + n] = tensor(s.routed_experts, np.int64)
            mask[first:first + n] = True
        start += len(s.prompt_ids) + len(s.response_ids)
    batch.routes, batch.route_mask = out.to(batch.input_ids.device), mask.to(batch.input_ids.device)


def teacher(samples: Sequence[Sample], width: int, k: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's log-probs ``[B, R]`` (``[B, R, K]`` and their ids with the top-k loss);
    zeros for a sample without them (the dummy: it trains nothing)."""
    shape = (len(samples), width, k) if k else (len(samples), width)
    logprobs, ids = torch.zeros(shape), torch.zeros(shape, dtype=torch.long) if k else None
    for i, s in enumerate(samples):
        if s.teacher_logprobs is None:
            continue
        r = len(s.response_ids)
        logprobs[i, :r] = tensor(s.teacher_logprobs, np.float32).reshape((r, k) if k else (r,))
        if ids is not None:
            ids[i, :r] = tensor(s.teacher_ids, np.int64).reshape(r, k)
    return logprobs.to(device), None if ids is None else ids.to(device)


def collate_packed(samples: Sequence[Sample], device: torch.device, model: Any) -> Batch:
    from streamrl.learner import packing

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
    ids = torch.cat([tensor(np.concatenate([s.prompt_ids, s.response_ids]), np.int64) for s in samples])
    pos_ids, cu, longest = packing.layout(lengths, device)
    return Batch(ids.unsqueeze(0).to(device), None, *targets(samples, starts, device),
                 packed=packing.forward_kwargs(model, pos_ids, cu, longest))


def collate_padded(samples: Sequence[Sample], device: torch.device, pad_token_id: int | None) -> Batch:
    pad = pad_token_id or 0
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    input_ids = torch.full((len(samples), max(lengths)), pad, dtype=torch.long)
    attention = torch.zeros((len(samples), max(lengths)), dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        input_ids[i, :n] = tensor(np.concatenate([s.prompt_ids, s.response_ids]), np.int64)
        attention[i, :n] = 1
    return Batch(input_ids.to(device), attention.to(device), *targets(samples, [0] * len(samples), device))


def targets(samples: Sequence[Sample], starts: Sequence[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``positions, response_ids, mask, valid`` ``[B, R]``: sample ``i``'s response token ``j``
    is predicted by the logits at ``starts[i] + len(prompt) - 1 + j`` of its row."""
    B, R = len(samples), max(max(len(s.response_ids) for s in samples), 1)
    positions = torch.zeros((B, R), dtype=torch.long)
    response = torch.zeros((B, R), dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.float32)
    valid = torch.zeros((B, R), dtype=torch.bool)
    for i, (s, start) in enumerate(zip(samples, starts)):
        check_prompt(s)
        p, r = len(s.prompt_ids), len(s.response_ids)
        positions[i, :r] = torch.arange(start + p - 1, start + p - 1 + r)
        response[i, :r] = tensor(s.response_ids, np.int64)
        mask[i, :r] = 1.0 if s.response_mask is None else tensor(s.response_mask, np.float32)
        valid[i, :r] = True
    return tuple(t.to(device) for t in (positions, response, mask, valid))


def dummy() -> Sample:
    """A sequence that trains nothing (mask 0): runs the collectives of a pass on a rank
    with fewer micro-batches than another."""
    return Sample(id="", group_id="", prompt_ids=np.zeros(1, np.int64), response_ids=np.zeros(1, np.int64),
                  reward=0.0, policy_version=0, behaviour_logprobs=np.zeros(1, np.float32),
                  response_mask=np.zeros(1, np.float32))


def check_prompt(s: Sample) -> None:
    if len(s.prompt_ids) == 0:
        raise ValueError(f"record {s.id}: empty prompt_ids (the first response token "
                         "needs a prompt token to be predicted from)")


def tensor(values: np.ndarray, dtype) -> torch.Tensor:
    """A copy as a tensor (record arrays are read-only views of the message bytes)."""
    return torch.from_numpy(np.array(values, dtype=dtype))
