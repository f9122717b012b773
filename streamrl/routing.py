"""MoE router replay: the experts a mixture-of-experts policy routed each token to, recorded where
the tokens were generated and replayed where they are trained.

Why: the rollout engine and the learner run the same weights through different kernels (and,
one version apart, not even the same weights); a router's top-k is discontinuous, so a tiny
difference in its logits sends a token to another expert and its log-prob jumps. Training on
tokens whose learner-side routing differs from the engine's is what made GRPO on MoE models
collapse (Megatron-LM's 30B-A3B report; verl's R3 mode). Replaying the recorded experts makes
the learner's forward pass route as the sampling did; the routing *weights* are still the
learner's own (its softmax over the router's logits, gathered at the replayed experts and
renormalised where the model renormalises), so the router keeps its gradients, as verl's
Megatron and VeOmni patches do.

verl's modes (``actor_rollout_ref.actor.{megatron,veomni}.router_replay.mode``), here
``learner.router_replay``:

- ``disabled``: each forward pass routes by itself.
- ``R2``: the learner's own old-log-prob pass (before the update) records its routing, and the
  update's passes replay it, so every epoch of a mini-batch routes as the weights it started
  from did.
- ``R3``: the rollout's routing (``rollout.return_routed_experts``, verl's
  ``rollout.enable_rollout_routing_replay``) is replayed in every policy pass of the learner
  (old log-probs and the update; the KL reference routes by itself, as verl's).

Layout, as vLLM returns it: one row per token the engine *fed* (the prompt's, then every
generated token but the last, which was sampled and never fed): ``rows = len(prompt) +
len(response) - 1``, each row ``[layers, topk]`` expert ids by absolute decoder-layer index. On a
record: ``routed_experts`` packed flat (uint8 up to 256 experts, else uint16), and
``routed_experts_shape`` ``[rows, layers, topk]``.

``RouterTap`` does both halves on a transformers model (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE...:
any ``*TopKRouter`` whose forward returns ``(logits, weights, indices)`` from a softmax top-k,
checked when the tap is installed); vLLM's and SGLang's payloads are decoded by
``from_vllm`` / ``from_sglang``.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

MODES = ("disabled", "R2", "R3")
#: the record's packed dtype for a model of ``num_experts``
ROUTE_DTYPES = {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2")}


def route_dtype(num_experts: int) -> str:
    """The narrowest packed dtype that holds every expert id."""
    return "uint8" if num_experts <= 256 else "uint16"


class RoutingError(ValueError):
    """Routing that does not fit (a payload of the wrong shape or type, a model without routers)."""


def from_vllm(b64: str) -> np.ndarray:
    """vLLM's ``choices[].routed_experts`` (``enable_return_routed_experts``): base64 of a
    ``.npy`` file, ``[tokens - 1, layers, topk]`` of an integer dtype. Read with
    ``allow_pickle=False``: a response never deserialises objects."""
    try:
        arr = np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise RoutingError(f"routed_experts: not a base64 .npy array ({exc})") from None
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise RoutingError(f"routed_experts: expected an integer [tokens, layers, topk] array, got "
                           f"{arr.dtype} {arr.shape}")
    return arr


def from_sglang(b64: str, layers: int, topk: int) -> np.ndarray:
    """SGLang's ``sglext.routed_experts`` / ``meta_info.routed_experts``: base64 of int32 ids,
    flat, ``[tokens - 1, layers, topk]`` row-major (the model's layers and top-k give the shape)."""
    try:
        flat = np.frombuffer(base64.b64decode(b64, validate=True), dtype="<i4")
    except (binascii.Error, ValueError) as exc:
        raise RoutingError(f"routed_experts: not base64 of int32 ({exc})") from None
    if flat.size % (layers * topk):
        raise RoutingError(f"routed_experts: {flat.size} ids are not whole rows of {layers} layers x top-{topk}")
    return flat.reshape(-1, layers, topk)


def pack(routes: np.ndarray, num_experts: int | None = None) -> tuple[np.ndarray, list[int]]:
    """``[rows, layers, topk]`` ids as the record's flat array (its narrowest dtype) and shape.
    Negative ids (SGLang's "no routed expert" on a dense layer) are refused: the learner would
    route them nowhere."""
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise RoutingError(f"routed experts: [rows, layers, topk], got shape {routes.shape}")
    top = int(routes.max()) + 1 if routes.size else 1
    if routes.size and int(routes.min()) < 0:
        raise RoutingError("routed experts: negative expert ids")
    dtype = route_dtype(max(num_experts or 0, top))
    if dtype == "uint16" and top > 65536:
        raise RoutingError(f"routed experts: expert id {top - 1} does not fit 16 bits")
    return np.ascontiguousarray(routes, dtype=ROUTE_DTYPES[dtype]).reshape(-1), [int(n) for n in routes.shape]


def unpack(flat: np.ndarray, shape: Any) -> np.ndarray:
    """A record's flat ids back to ``[rows, layers, topk]``; ``RoutingError`` when they do not fit."""
    if not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise RoutingError(f"routed_experts_shape: [rows, layers, topk], got {shape!r}")
    if flat.size != shape[0] * shape[1] * shape[2]:
        raise RoutingError(f"routed_experts: {flat.size} ids for shape {list(shape)}")
    return flat.reshape(shape)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: Any) -> list[tuple[int, Any]]:
    """``(decoder layer index, router module)`` of each MoE layer, in layer order: transformers'
    ``*TopKRouter`` / ``*TopkRouter`` modules (``RouterTap`` checks they return ``(logits,
    weights, indices)`` of a softmax top-k)."""
    out = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith(("TopKRouter", "TopkRouter")) and hasattr(module, "top_k"):
            m = _LAYER.search(name)
            if m is None:
                raise RoutingError(f"router {name!r}: no decoder layer index in its name")
            out.append((int(m.group(1)), module))
    return sorted(out, key=lambda t: t[0])


def _weights(module: Any, logits: Any, indices: Any) -> Any:
    """The routing weights of ``indices`` from the router's own ``logits``: softmax, gathered,
    renormalised over the top-k where the model does (Mixtral always; Qwen-MoE per
    ``norm_topk_prob``), in the logits' dtype, as the router's own forward computes them."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    if getattr(module, "norm_topk_prob", True):
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


class RouterTap:
    """Forward hooks on every MoE router of a transformers model: ``recording()`` keeps the
    experts each forward pass chose; ``replaying(targets, mask)`` makes the routers choose
    ``targets`` (``[rows, layers, topk]``, one row per token the pass sees, in the order the
    routers see them: ``[B, L]`` flattened) where ``mask`` is True, their own top-k elsewhere
    (padding, tokens with no recorded routing). Outside both, the routers are untouched.

    Installed, it checks that each router's weights are the softmax top-k ``_weights``
    recomputes (so a replayed expert gets the weight the model would give it); a router that
    computes them otherwise (sigmoid scores, grouped top-k, a bias) is refused by name."""

    def __init__(self, model: Any):
        import torch

        routers = find_routers(model)
        if not routers:
            raise RoutingError(f"{type(model).__name__} has no MoE routers (*TopKRouter modules): router replay "
                               "needs a mixture-of-experts policy")
        self.layers = int(getattr(model.config, "num_hidden_layers", routers[-1][0] + 1))
        self.topk = int(routers[0][1].top_k)
        self.num_experts = int(getattr(routers[0][1], "num_experts", 0) or routers[0][1].weight.shape[0])
        self._layer = {id(m): layer for layer, m in routers}
        self.moe_layers = [layer for layer, _ in routers]
        self._mode: str | None = None
        self.recorded: dict[int, list[Any]] = {}
        self._targets: Any = None
        self._mask: Any = None
        for _, module in routers:  # the weights are the ones _weights recomputes
            w = module.weight
            x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
            with torch.no_grad():
                out = module(x)
                if not (isinstance(out, tuple) and len(out) == 3):
                    raise RoutingError(f"{type(module).__name__}: returns no (logits, weights, indices) (its MoE block "
                                       "picks the experts): router replay cannot replace its choice")
                logits, scores, idx = out
                if not torch.allclose(_weights(module, logits, idx).float(), scores.float(), atol=1e-3, rtol=1e-3):
                    raise RoutingError(f"{type(module).__name__}: its routing weights are not a softmax top-k of its "
                                       "logits; router replay cannot recompute them for replayed experts")
        self._handles = [m.register_forward_hook(self._hook) for _, m in routers]

    @property
    def active(self) -> bool:
        """Replaying now (a pass inside ``replaying``)."""
        return self._mode == "replay"

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, module: Any, args: Any, output: Any) -> Any:
        if self._mode is None:
            return None
        logits, _, indices = output
        layer = self._layer[id(module)]
        if self._mode == "record":
            self.recorded.setdefault(layer, []).append(indices.detach())
            return None
        targets = self._targets[:, layer].to(indices.device)
        if targets.shape != indices.shape:
            raise RoutingError(f"router replay: layer {layer} routes {tuple(indices.shape)} rows x top-k, the "
                               f"replayed routing has {tuple(targets.shape)}")
        import torch

        chosen = torch.where(self._mask.to(indices.device).unsqueeze(-1), targets, indices)
        return logits, _weights(module, logits, chosen), chosen

    @contextmanager
    def recording(self) -> Iterator[dict[int, list[Any]]]:
        """Record every router call meanwhile: ``{layer: [indices of each call]}``."""
        self._mode, self.recorded = "record", {}
        try:
            yield self.recorded
        finally:
            self._mode = None

    @contextmanager
    def replaying(self, targets: Any, mask: Any) -> Iterator[None]:
        """Route as ``targets`` (``[rows, layers, topk]`` long) where ``mask`` (``[rows]`` bool)."""
        self._mode, self._targets, self._mask = "replay", targets.long(), mask.bool()
        try:
            yield
        finally:
            self._mode, self._targets, self._mask = None, None, None

    def stacked(self) -> Any:
        """The routing recorded meanwhile as ``[rows, layers, topk]``, each layer's calls end to
        end (one forward pass, or the chunks of one sequence; a layer without a router, a dense
        one, holds zeros), as ``replaying`` takes it."""
        import torch

        per_layer = {layer: torch.cat(calls) for layer, calls in self.recorded.items()}
        first = next(iter(per_layer.values()))
        out = torch.zeros((first.shape[0], self.layers, self.topk), dtype=torch.long, device=first.device)
        for layer, rows in per_layer.items():
            out[:, layer] = rows
        return out


def generated_routes(recorded: dict[int, list[Any]], layers: int, topk: int, attention: Any,
                     lengths: list[int]) -> list[np.ndarray]:
    """The routing of each row of one ``model.generate`` call: the prefill's call (left-padded
    prompts, ``attention`` its mask) then one call per decoding step; row ``i`` keeps its prompt's
    tokens and its first ``lengths[i] - 1`` generated ones (the last sampled token was never fed),
    ``[len(prompt) + lengths[i] - 1, layers, topk]``."""
    import torch

    batch, width = attention.shape
    per_layer = {}
    for layer, calls in recorded.items():
        prefill = calls[0].reshape(batch, width, topk)
        steps = [c.reshape(batch, 1, topk) for c in calls[1:]]
        per_layer[layer] = torch.cat([prefill, *steps], dim=1).cpu()
    keep = attention.bool().cpu()
    out = []
    for i, n in enumerate(lengths):
        p = int(keep[i].sum())
        rows = np.zeros((p + max(n - 1, 0), layers, topk), dtype=np.int64)
        for layer, seq in per_layer.items():
            full = torch.cat([seq[i, :width][keep[i]], seq[i, width:width + max(n - 1, 0)]])
            rows[:, layer] = full.numpy()
        out.append(rows)
    return out


__all__ = ["MODES", "RouterTap", "RoutingError", "find_routers", "from_sglang", "from_vllm", "generated_routes",
           "pack", "route_dtype", "unpack"]
