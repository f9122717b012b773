"""The policy model and its tokenizer, shared by the learner (trains it) and the transformers
rollout backend (samples from it).

A policy is named by a spec: ``tiny`` (a small causal LM built from a config with a byte-level
tokenizer: no download, trains on CPU in seconds; for tests and the local default) or a local
directory in Hugging Face layout (``config.json``, ``*.safetensors``, tokenizer files), which is
also what the learner writes for each version (``streamrl.weights.save_policy``). Nothing is fetched from a hub.
torch and transformers are the ``[gpu]`` extra, imported here lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamrl.errors import ConfigError, need

TINY_SPEC = "tiny"


def byte_tokenizer():
    """A byte-level tokenizer built in code: 256 byte tokens plus ``<pad>``, ``<bos>``,
    ``<eos>``, ``<unk>`` (never produced; present so a reload adds no token). Any text
    round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<pad>", "<bos>", "<eos>", "<unk>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def tiny_model(vocab_size: int, seed: int = 0, hidden_size: int = 64, layers: int = 2,
               overrides: dict[str, Any] | None = None):
    """A 2-layer Qwen2-style causal LM (~0.1M parameters besides embeddings); ``overrides``
    changes its config before it is built (``apply_overrides``)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    apply_overrides(config, overrides or {})
    return Qwen2ForCausalLM(config)


def tiny_moe_model(vocab_size: int, seed: int = 0, experts: int = 8, topk: int = 2, hidden_size: int = 32,
                   layers: int = 2):
    """A tiny Qwen2-MoE causal LM (``experts`` experts, top-``topk``, a shared expert; weights
    drawn wide enough that routing is not a tie everywhere): the mixture-of-experts policy of
    router replay's tests and bench (``streamrl.routing``), saved as a directory to be a policy."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                            moe_intermediate_size=hidden_size, shared_expert_intermediate_size=hidden_size,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            num_experts=experts, num_experts_per_tok=topk, norm_topk_prob=False,
                            max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2)
    return Qwen2MoeForCausalLM(config)


def perturb(model: Any, noise: float, seed: int = 1) -> None:
    """Add Gaussian noise of ``noise`` x each tensor's std to ``model``'s weights (a rollout's
    weights a little off the learner's, for router replay's measurements)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * noise * float(p.std()))


#: verl's override_config keys that pick a kernel, not a config value: not applied (the same numbers)
KERNEL_OVERRIDES = ("attn_implementation",)


def model_overrides(override_config: Any) -> dict[str, Any]:
    """verl's ``model.override_config`` as the changes to the model's config it makes: its
    ``model_config`` entry where it has one (the Megatron engine's form, which verl reads alike),
    less the attention kernel's pick (``KERNEL_OVERRIDES``: the learner and the engines pick theirs)."""
    if not override_config:
        return {}
    if not isinstance(override_config, dict):
        raise ConfigError(f"override_config: a mapping of the model config's fields (got {override_config!r})")
    tree = override_config.get("model_config", override_config)
    return {k: v for k, v in dict(tree).items() if k not in KERNEL_OVERRIDES}


def apply_overrides(config: Any, overrides: dict[str, Any], where: str = "override_config") -> None:
    """Set ``overrides`` on a transformers config as verl's ``update_model_config`` does: a
    mapping updates the sub-config of its name (``rope_scaling``, ``text_config``), any other
    value is set as the field (``max_position_embeddings: 8192``, ``attention_dropout: 0.1``)."""
    for key, value in overrides.items():
        if isinstance(value, dict):
            sub = getattr(config, key, None)
            if sub is None:
                raise ConfigError(f"config field '{where}.{key}': the model's config has no {key} to update")
            if isinstance(sub, dict):  # a plain mapping field (rope_scaling): its entries updated
                sub.update(value)
            else:
                apply_overrides(sub, value, f"{where}.{key}")
        else:
            setattr(config, key, value)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of policy ``spec`` (``tiny`` or a local directory) alone: the feed counts
    prompt tokens with it (``feed.max_prompt_length``)."""
    need("transformers", "cpu", "feed.max_prompt_length")
    if spec == TINY_SPEC:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    path = Path(spec.removeprefix("file://"))
    if not path.is_dir():
        raise ConfigError(f"config field 'feed.tokenizer': {spec!r} is no directory (the policy's tokenizer "
                          f"counts prompt tokens for feed.max_prompt_length)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_policy(spec: str, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                overrides: dict[str, Any] | None = None, where: str = "override_config") -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``spec`` (``tiny`` or a local directory), in eval mode on
    ``device``; ``overrides`` (``model_overrides``' form) change its config before the weights
    load (verl's ``model.override_config``; ``where`` names the field in an error)."""
    torch = need("torch", "cpu", "the policy model")
    need("transformers", "cpu", "the policy model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec == TINY_SPEC:
        tokenizer = byte_tokenizer()
        model = tiny_model(len(tokenizer), seed=seed, overrides=overrides)
    else:
        path = Path(spec.removeprefix("file://"))
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"policy {spec!r}: no config.json there (a directory in Hugging Face layout, or 'tiny')")
        from transformers import AutoConfig

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        apply_overrides(config, overrides or {}, where)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, config=config,
                                                     dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(device).eval(), tokenizer
