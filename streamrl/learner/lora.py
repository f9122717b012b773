"""LoRA on the learner (``learner.lora``): the policy wrapped with PEFT, and the three ways its
weights leave the learner.

- **Training**: ``wrap`` injects PEFT's LoRA layers into the loaded model; only their
  ``lora_A`` / ``lora_B`` matrices require gradients, so the optimizer keeps states for them
  alone. The frozen base is the model as loaded (``learner.dtype``), once; the KL reference is
  that base with the adapter switched off (``PeftModel.disable_adapter``), no second model.
- **Publishing**: ``adapter_state`` (the adapter's tensors, gathered from FSDP2 shards when the
  model is sharded) and ``save_adapter`` (PEFT's ``adapter_model.safetensors`` +
  ``adapter_config.json``); ``base_state`` (the frozen base under Hugging Face names, written once
  per learner start); ``merged_state`` (the base with ``W + scale * B @ A`` folded in:
  ``learner.lora.merge_for_servers``, for servers without LoRA).
- **Sharding**: the adapters are parameters of the decoder layers they sit in, so FSDP2's
  ``fully_shard`` of each layer shards them with the layer (dim 0, as every parameter):
  sharded, not replicated. Gathering them for a version moves only the adapter's bytes.

PEFT is the ``[cpu]``/``[gpu]`` extras' ``peft``, imported here lazily.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamrl.learner.config import LoraConfig

#: PEFT's adapter name inside the learner's model (one adapter)
ADAPTER = "default"


def peft_config(cfg: "LoraConfig") -> Any:
    """PEFT's ``LoraConfig`` for ``learner.lora``."""
    from streamrl.errors import need

    peft = need("peft", "gpu", "learner.lora")
    targets = list(cfg.target_modules)
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=targets[0] if targets == ["all-linear"] else targets,
                           bias="none", task_type="CAUSAL_LM")


def wrap(model: Any, cfg: "LoraConfig") -> Any:
    """The model with LoRA adapters (B = 0 at first: the wrapped model computes what the base
    does); every other parameter frozen."""
    from peft import get_peft_model

    from streamrl.errors import ConfigError

    try:
        wrapped = get_peft_model(model, peft_config(cfg))
    except ValueError as exc:  # e.g. a target module the model does not have
        raise ConfigError(f"config field 'learner.lora.target_modules': {str(exc).splitlines()[0]}") from None
    # PEFT keeps the base model's dtype for the adapters unless told; make them the learner's dtype
    dtype = next(p for p in model.parameters()).dtype
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return wrapped


def is_lora(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def _full(t: Any) -> Any:
    """A parameter whole on this process's CPU (a DTensor gathered: a collective, every rank)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.cpu()


def adapter_state(model: Any) -> dict[str, Any]:
    """The adapter's tensors under the model's own names (``...q_proj.lora_A.default.weight``),
    whole, on the CPU. Sharded: every rank must call it (each parameter is gathered in turn)."""
    return {name: _full(p) for name, p in model.named_parameters() if p.requires_grad}


def _strip(name: str) -> str:
    """A PEFT model's parameter name as the base model's own (Hugging Face) name."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def base_state(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The frozen base's tensors under Hugging Face names, from the whole model's ``state``; a
    tied weight once (``lm_head.weight`` of a tied embedding, wrapped by an adapter or not)."""
    first = {_strip(n) for n, _ in model.named_parameters()}
    aliases = {_strip(n) for n, _ in model.named_parameters(remove_duplicate=False)} - first
    out = {}
    for k, v in state.items():
        name = _strip(k)
        if ".lora_" not in k and name not in aliases:
            out[name] = v
    return out


def merged_state(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The base with each adapter folded in (``W + scaling * B @ A``, in float32, then the
    weight's dtype), under Hugging Face names: what the model computes with its adapter on."""
    from peft.tuners.lora import LoraLayer

    out = base_state(model, state)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in getattr(module, "lora_A", {}):
            continue
        a = state.get(f"{name}.lora_A.{ADAPTER}.weight")
        b = state.get(f"{name}.lora_B.{ADAPTER}.weight")
        if a is None or b is None:
            raise ValueError(f"{name}: a LoRA layer that is not a linear one cannot be merged here")
        key = _strip(f"{name}.base_layer.weight")
        if key not in out:  # a weight tied to another (the output head of a tied embedding)
            raise ValueError(f"{key}: an adapter on a tied weight cannot be merged (the tie would carry the "
                             "change to the embedding); leave it out of learner.lora.target_modules")
        w = out[key]
        delta = (b.float() @ a.float()) * float(module.scaling[ADAPTER])
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        out[key] = (w.float() + delta).to(w.dtype)
    return out


def base_model(model: Any) -> Any:
    """The Hugging Face model inside the PEFT wrapper (its config, its ``save_pretrained``)."""
    return model.get_base_model()


def save_adapter(model: Any, directory: str | Path, state: dict[str, Any]) -> Path:
    """PEFT's layout at ``directory`` (``adapter_model.safetensors`` + ``adapter_config.json``),
    from ``state`` (``adapter_state``), atomically: written beside it, then renamed."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER, save_embedding_layers=False)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = model.peft_config[ADAPTER]
    inference = config.inference_mode
    config.inference_mode = True  # what a reader loads it as
    try:
        config.save_pretrained(str(tmp))
    finally:
        config.inference_mode = inference
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory
