"""Padding-free micro-batches (``learner.use_remove_padding``, verl's key of the same name).

A packed micro-batch is one row: its sequences concatenated, each with its own position ids
(0, 1, ... from its start) and attention kept inside each sequence. RL responses spread from
tens to thousands of tokens, so a padded micro-batch (every sequence right-padded to the longest)
spends much of each forward and backward on padding; packed, the linear layers, the norms and the
LM head see only real tokens and attention costs the sum of each sequence's own square.

How attention stays inside a sequence: the model runs with the attention implementation
``streamrl_varlen`` (registered in transformers' ``AttentionInterface``), which reads the
boundaries (``cu_seq_lens_q``, transformers' own keyword for packed sequences) and runs causal
attention on each sequence: varlen flash-attention on CUDA in bf16/fp16 where ``flash_attn`` is
installed, else torch's SDPA on buckets of similar lengths. Without those boundaries (a padded or KV-cached pass:
a long sequence run in chunks, a model that cannot pack) it is exactly transformers' SDPA.

Whether a model can pack is checked, not assumed (``enable``): a model whose attention does not
go through transformers' attention interface, or whose forward does not take prepared masks,
fails the check's two-sequence comparison with the padded forward and trains padded.

Without flash-attn (the CPU, or CUDA without the package), attention runs as SDPA on buckets of
similar lengths (``buckets``): one call per sequence made many short sequences slower than
padding, one padded call over all of them wastes a long tail's square.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


ATTENTION = "streamrl_varlen"
_REGISTERED = False


def register() -> bool:
    """Register ``streamrl_varlen`` with transformers (once); False when this transformers has
    no attention interface (then nothing packs)."""
    global _REGISTERED
    if _REGISTERED:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # padded / cached passes: SDPA's masks
    _REGISTERED = True
    return True


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature (``query`` ``[1, heads, T, dim]``, output ``[1, T, heads,
    dim]``). Packed (``cu_seq_lens_q`` given): causal attention within each sequence; else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
        return _flash(query, key, value, cu, int(kwargs.get("max_length_q") or 0), dropout, scaling), None
    return _bucketed_sdpa(module, query, key, value, cu, dropout, scaling), None


#: ``learner.use_remove_padding: auto`` packs a mini-batch whose padded micro-batches would hold at
#: least this share of padding. Measured on 2 CPU threads (``streamrl bench learner --shapes`` and
#: sweeps of response lengths on the tiny policy): packed and padded steps are within noise of each
#: other up to ~10-20% padding (packing's gathers cost what it saves), packing wins from there
#: (0.82x the time at 38%, 0.2-0.4x on RL's long mixed lengths).
AUTO_MIN_PADDING = 0.2

#: a bucket's padded attention may cost at most this many times the sum of its sequences' own
#: squares (padded to the bucket's longest), and a bucket whose longest is at most ``SHORT_TOKENS``
#: takes any shorter sequence: for short sequences a call costs more than the padding saved.
#: Measured on the ``mini`` model, 1 thread, RL's log-uniform 32-2,048 mix: seconds a step 0.94
#: (1.0: equal lengths only), 1.00 (1.25), 1.15 (1.5), 1.32 (2.0)
BUCKET_WASTE = 1.25
SHORT_TOKENS = 32


def buckets(lengths: Sequence[int], waste: float | None = None) -> list[list[int]]:
    """Indices of ``lengths`` in groups, each one SDPA call: longest first, a sequence joins the
    current group while the group's longest is at most ``SHORT_TOKENS`` or its padded attention
    (``count x longest**2``) stays within ``waste`` (``BUCKET_WASTE``) times the sum of their own
    squares. Short sequences make one group; RL's long log-uniform mixes about one per sequence."""
    waste = BUCKET_WASTE if waste is None else waste
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    own = 0
    for i in order:
        if out:
            longest = lengths[out[-1][0]]
            if longest <= SHORT_TOKENS or (len(out[-1]) + 1) * longest ** 2 <= waste * (own + lengths[i] ** 2):
                out[-1].append(i)
                own += lengths[i] ** 2
                continue
        out.append([i])
        own = lengths[i] ** 2
    return out


@dataclass(frozen=True)
class _Bucket:
    """One SDPA call: a lone sequence as a slice of the packed row (``span``, a view: no copy),
    or several gathered into a right-padded batch (``index`` ``[count, longest]`` into the row,
    the pad slot ``T`` past each one's end; ``valid`` its mask)."""

    span: tuple[int, int] | None = None
    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None


@dataclass(frozen=True)
class _Plan:
    """The buckets of one packed row, and ``inverse``: the permutation from their output rows,
    concatenated, back to the packed order. ``uniform``: every sequence that many tokens, so the
    row is a ``[count, uniform]`` batch as it is (no buckets)."""

    buckets: list[_Bucket]
    inverse: torch.Tensor | None = None
    uniform: int = 0


_LAST_PLAN: tuple[torch.Tensor, _Plan] | None = None  # every layer of one forward shares ``cu``


def _plan(cu: torch.Tensor) -> _Plan:
    global _LAST_PLAN
    if _LAST_PLAN is not None and _LAST_PLAN[0] is cu:
        return _LAST_PLAN[1]
    bounds = cu.tolist()
    starts, lengths = bounds[:-1], [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    if len(set(lengths)) == 1:
        plan = _Plan([], uniform=lengths[0])
    else:
        out, rows = [], []
        for group in buckets(lengths):
            if len(group) == 1:
                lo, hi = starts[group[0]], starts[group[0]] + lengths[group[0]]
                out.append(_Bucket(span=(lo, hi)))
                rows.append(torch.arange(lo, hi, device=cu.device))
                continue
            start = torch.tensor([starts[i] for i in group], device=cu.device)[:, None]
            n = torch.tensor([lengths[i] for i in group], device=cu.device)[:, None]
            steps = torch.arange(lengths[group[0]], device=cu.device)[None, :]
            mask = steps < n
            at = torch.where(mask, start + steps, bounds[-1])
            out.append(_Bucket(index=at, valid=mask))
            rows.append(at[mask])
        plan = _Plan(out, torch.argsort(torch.cat(rows)))
    _LAST_PLAN = (cu, plan)
    return plan


def _bucketed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   cu: torch.Tensor, dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal attention within each packed sequence, one SDPA call per bucket (``buckets``): a
    lone sequence sliced from the row, several gathered into a right-padded batch (right padding
    needs no mask: a causal query never sees the keys past it); the outputs put back in packed
    order. Measured (``streamrl bench learner --shapes``): one call per sequence made the default
    task's many short sequences 1.8x slower than padding; buckets cost what padding does there
    and keep packing's gain on RL's long mixed lengths."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)[0]

    plan = _plan(cu)
    if plan.uniform:  # a view, no copy: [1, heads, count * n, dim] -> [count, heads, n, dim]
        heads, n = query.shape[1], plan.uniform
        out = attend(*(t[0].unflatten(1, (-1, n)).transpose(0, 1) for t in (query, key, value)))
        return out.reshape(1, -1, heads, out.shape[-1])
    padded = None  # the row with a zero slot at its end, where a gather points past a sequence
    outs = []
    for b in plan.buckets:
        if b.span is not None:
            lo, hi = b.span
            outs.append(attend(query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi])[0])
            continue
        if padded is None:
            padded = [torch.cat([t[0], t.new_zeros(t.shape[1], 1, t.shape[3])], dim=1) for t in (query, key, value)]
        out = attend(*(t[:, b.index].transpose(0, 1) for t in padded))  # [count, longest, heads, dim]
        outs.append(out[b.valid])  # [its tokens, heads, dim]
    return torch.cat(outs).index_select(0, plan.inverse).unsqueeze(0)


def _flash_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, max_len: int,
           dropout: float, scaling: float | None) -> torch.Tensor:
    """flash-attn's varlen kernel on the packed row (GQA native: fewer key/value heads)."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, dim]
    cu = cu.to(torch.int32)
    max_len = max_len or int((cu[1:] - cu[:-1]).max())
    out = _flash_varlen()(q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scaling,
                          causal=True)
    return out.unsqueeze(0)


def layout(lengths: list[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(position_ids [1, T], cu_seq_lens [n + 1] int32, longest)`` of sequences of ``lengths``
    packed in this order."""
    n = torch.tensor(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(n, 0)
    position_ids = (torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1].long(), n)).unsqueeze(0).to(device)
    return position_ids, cu.to(device), max(lengths)


def forward_kwargs(model: Any, position_ids: torch.Tensor, cu: torch.Tensor, longest: int) -> dict[str, Any]:
    """The keywords of a packed forward: the position ids, the boundaries, and prepared masks of
    ``None`` for each layer type (no [T, T] mask built: the boundaries say it all)."""
    config = getattr(model, "config", None)
    types = set(getattr(config, "layer_types", None) or ("full_attention",))
    return {"position_ids": position_ids, "attention_mask": {t: None for t in types},
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def enable(model: Any) -> str:
    """Switch ``model`` to ``streamrl_varlen`` when it can pack, checked on two short sequences
    (packed log-probs against the padded forward's): ``""`` when it packs, else why not (the
    model left as it was)."""
    name = type(model).__name__
    if "sliding_attention" in set(getattr(model.config, "layer_types", None) or ()):
        return f"{name} has sliding-window layers, which streamrl_varlen does not window"
    if not register() or not getattr(model, "_supports_attention_backend", False):
        return f"{name} cannot pack sequences (no transformers attention interface)"
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(ATTENTION)
        ok, error = _check(model)
    except Exception as exc:  # an architecture whose forward does not take what packing passes
        ok, error = False, repr(exc)
    if ok:
        return ""
    model.set_attn_implementation(before)
    return f"{name}: packed forward differs from the padded one ({error})"


def kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Which attention a packed forward runs here (for the learner's start line)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
        return "flash-attn's varlen kernel"
    return f"SDPA, one call per bucket of similar lengths (padded attention <= {BUCKET_WASTE:g}x their own)"


def _check(model: Any) -> tuple[bool, str]:
    """Does ``model``'s architecture pack? Asked of a one-layer fp32 copy of its config (small
    vocabulary, random weights): what is checked is that the forward keeps attention inside
    each sequence, which one layer shows, without a bf16 model's rounding in the comparison.
    An architecture whose config will not shrink so is asked in its own weights and dtype."""
    try:
        probe = _one_layer(model)
    except Exception:  # an unusual config: the model itself
        return _compare(model)
    probe.set_attn_implementation(ATTENTION)
    return _compare(probe)


def _one_layer(model: Any) -> Any:
    import copy

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    config.vocab_size = min(int(config.vocab_size), 512)
    torch.manual_seed(0)
    return type(model)(config).float()


@torch.no_grad()
def _compare(model: Any) -> tuple[bool, str]:
    """Log-probs of two sequences (3 and 6 tokens) packed against padded, in the model's dtype."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        vocab = int(model.config.vocab_size)
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (3, 6)]
        ids = torch.zeros(2, 6, dtype=torch.long)
        mask = torch.zeros(2, 6, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = s, 1
        padded = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        pos, cu, longest = layout([3, 6], device)
        packed = model(input_ids=torch.cat(seqs).unsqueeze(0).to(device),
                       **forward_kwargs(model, pos, cu, longest)).logits.float()[0]
        want = torch.cat([padded[0, :3], padded[1, :6]])
        err = float((packed.log_softmax(-1) - want.log_softmax(-1)).abs().max())
        tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
        return err <= tol, f"max log-prob difference {err:.2e}"
    finally:
        model.train(was_training)
