"""Who trains which sequences, and in which forward passes: a mini-batch split over the ranks
balanced by tokens, and each rank's share split into micro-batches under a token budget.

Pure functions of the sequence lengths, so every rank computes every rank's plan and they agree
without talking (the collectives of FSDP2 need the same number of forward/backward passes on
every rank; ``pad_units`` says how many each must run).

Costs are counted as a forward pass costs: padded (``packed=False``, the trainer pads on the
right), ``sequences x longest length``; packed (``learner.use_remove_padding``, the sequences
concatenated without padding), the sum of the lengths. verl's ``use_dynamic_bsz`` /
``ppo_max_token_len_per_gpu`` is the same idea; unlike verl a sequence longer than the budget is
not refused: it runs alone, in chunks of the budget with its KV cache kept (``Trainer``), so no
forward pass is above the budget.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


def balance(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``parts`` groups of nearly equal total length (longest first to
    the lightest group; ties by index, so the result is deterministic). Every group gets at
    least one index when there are enough."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, 0, p) for p in range(parts)]  # (tokens, count, part)
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        tokens, count, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, p))
    return [sorted(group) for group in out]


@dataclass(frozen=True)
class MicroBatch:
    """Indices of one forward/backward unit; ``chunks`` > 1: one sequence longer than the budget,
    run in that many forward passes."""

    indices: tuple[int, ...]
    chunks: int = 1


def split(lengths: Sequence[int], max_tokens: int = 0, max_sequences: int = 8,
          packed: bool = False) -> list[MicroBatch]:
    """Micro-batches of the indices of ``lengths``: with ``max_tokens`` > 0, padded, each holds
    as many sequences (longest first) as keep ``count x longest <= max_tokens``; packed, as few
    micro-batches as hold the sequences with ``sum of lengths <= max_tokens`` (``pack``). A
    sequence above the budget alone, in ``ceil(length / max_tokens)`` chunks. Without a budget,
    ``max_sequences`` per micro-batch in index order (the trainer's historical behaviour)."""
    n = len(lengths)
    if max_tokens <= 0:
        return [MicroBatch(tuple(range(lo, min(lo + max_sequences, n)))) for lo in range(0, n, max_sequences)]
    if packed:
        return pack(lengths, max_tokens)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    out: list[MicroBatch] = []
    current: list[int] = []
    for i in order:
        if lengths[i] > max_tokens:
            out.append(MicroBatch((i,), -(-lengths[i] // max_tokens)))
            continue
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > max_tokens:
            out.append(MicroBatch(tuple(current)))
            current = []
        current.append(i)
    if current:
        out.append(MicroBatch(tuple(current)))
    return out


def pack(lengths: Sequence[int], max_tokens: int) -> list[MicroBatch]:
    """Packed micro-batches: the fewest ``k`` (from ``ceil(total / max_tokens)`` up) for which the
    balanced partition of ``balance`` (longest first to the lightest) keeps every part within
    ``max_tokens`` real tokens; balanced rather than filled first-fit so that the passes cost
    alike (the last one is not a small remainder). A sequence above the budget runs alone, chunked."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out = [MicroBatch((i,), -(-lengths[i] // max_tokens)) for i in order if lengths[i] > max_tokens]
    rest = [i for i in order if lengths[i] <= max_tokens]
    if not rest:
        return out
    k = max(1, -(-sum(lengths[i] for i in rest) // max_tokens))
    while True:  # ends: with k = len(rest) every part holds one sequence, each within the budget
        parts = [p for p in balance([lengths[i] for i in rest], k) if p]
        if all(sum(lengths[rest[j]] for j in p) <= max_tokens for p in parts):
            break
        k += 1
    parts.sort(key=lambda p: -sum(lengths[rest[j]] for j in p))
    return out + [MicroBatch(tuple(sorted(rest[j] for j in p))) for p in parts]


def forward_tokens(lengths: Sequence[int], mb: MicroBatch, max_tokens: int, packed: bool = False) -> int:
    """The most tokens one forward pass of ``mb`` processes (what the budget bounds)."""
    if mb.chunks > 1:
        return min(max_tokens, lengths[mb.indices[0]])
    if packed:
        return sum(lengths[i] for i in mb.indices)
    return len(mb.indices) * max(lengths[i] for i in mb.indices)
