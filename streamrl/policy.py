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


def tiny_model(vocab_size: int, seed: int = 0, hidden_size: int = 64, layers: int = 2):
    """A 2-layer Qwen2-style causal LM (~0.1M parameters besides embeddings)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


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


def load_policy(spec: str, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``spec`` (``tiny`` or a local directory), in eval mode on
    ``device``."""
    torch = need("torch", "cpu", "the policy model")
    need("transformers", "cpu", "the policy model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec == TINY_SPEC:
        tokenizer = byte_tokenizer()
        model = tiny_model(len(tokenizer), seed=seed)
    else:
        path = Path(spec.removeprefix("file://"))
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"policy {spec!r}: no config.json there (a directory in Hugging Face layout, or 'tiny')")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(device).eval(), tokenizer
