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
installed, else torch's SDPA per sequence. Without those boundaries (a padded or KV-cached pass:
a long sequence run in chunks, a model that cannot pack) it is exactly transformers' SDPA.

Whether a model can pack is checked, not assumed (``enable``): a model whose attention does not
go through transformers' attention interface, or whose forward does not take prepared masks,
fails the check's two-sequence comparison with the padded forward and trains padded.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

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
    bounds = cu.tolist()
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out, _ = sdpa_attention_forward(module, query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], None,
                                        dropout=dropout, scaling=scaling, is_causal=True)
        outs.append(out)
    return torch.cat(outs, dim=1), None


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
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return position_ids, cu.to(device), max(lengths)


def forward_kwargs(model: Any, position_ids: torch.Tensor, cu: torch.Tensor, longest: int) -> dict[str, Any]:
    """The keywords of a packed forward: the position ids, the boundaries, and prepared masks of
    ``None`` for each layer type (no [T, T] mask built: the boundaries say it all)."""
    config = getattr(model, "config", None)
    types = set(getattr(config, "layer_types", None) or ("full_attention",))
    return {"position_ids": position_ids, "attention_mask": {t: None for t in types},
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def enable(model: Any) -> bool:
    """Switch ``model`` to ``streamrl_varlen`` when it can pack, checked on two short sequences
    (packed log-probs against the padded forward's); else leave it as it was and say why."""
    name = type(model).__name__
    if "sliding_attention" in set(getattr(model.config, "layer_types", None) or ()):
        log.warning("learner: %s has sliding-window layers, which streamrl_varlen does not window: "
                    "micro-batches stay padded (learner.use_remove_padding)", name)
        return False
    if not register() or not getattr(model, "_supports_attention_backend", False):
        log.warning("learner: %s cannot pack sequences (no transformers attention interface): "
                    "micro-batches stay padded (learner.use_remove_padding)", name)
        return False
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(ATTENTION)
        ok, error = _check(model)
    except Exception as exc:  # an architecture whose forward does not take what packing passes
        ok, error = False, repr(exc)
    if not ok:
        model.set_attn_implementation(before)
        log.warning("learner: %s: packed forward differs from the padded one (%s): micro-batches stay "
                    "padded (learner.use_remove_padding)", name, error)
    return ok


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
