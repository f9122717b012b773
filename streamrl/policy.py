"""The policy model and its tokenizer, shared by the learner (trains it) and the transformers
rollout backend (samples from it).

A policy is named by a spec: ``tiny`` (a small causal LM built from a config with a byte-level
tokenizer: no download, trains on CPU in seconds; for tests and the local default) or a local
directory in Hugging Face layout (``config.json``, ``*.safetensors``, tokenizer files), which is
also what the learner writes for each version (``save_policy``). Nothing is fetched from a hub.
torch and transformers are the ``[gpu]`` extra, imported here lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    from streamrl.errors import ConfigError, need

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
    from streamrl.errors import need

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


def without_tied_copies(model: Any, state_dict: dict) -> dict:
    """``state_dict`` without the names under which ``model`` holds a parameter a second time
    (``lm_head.weight`` of a tied embedding). A state dict gathered from FSDP2 shards has a
    separate tensor per name, so ``save_pretrained`` cannot see the tie and would write the
    weight twice: the file would depend on the rank count that wrote it."""
    first = {name for name, _ in model.named_parameters()}  # one name per parameter
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first
    return {k: v for k, v in state_dict.items() if k not in aliases}


def save_policy(model: Any, tokenizer: Any, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write weights (safetensors), config and tokenizer to ``directory``, atomically: into a
    sibling temporary directory, then renamed, so a reader never sees half a version.
    ``state_dict``: the weights to write instead of ``model``'s (a sharded model's, gathered)."""
    import os
    import shutil

    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if state_dict is not None:
        state_dict = without_tied_copies(model, state_dict)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


# -- published versions as Hugging Face directories (``streamrl export``) -------------------------
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: a directory holding a LoRA adapter (learner.lora)


def version_dirs(run_dir: str | Path) -> tuple[Path, dict[int, Path]]:
    """The weights directory of a run (``RUN/weights``, ``RUN/learner/weights``, or the weights
    directory itself) and its published versions (``v<N>``) by number."""
    root = Path(run_dir)
    for weights in (root / "weights", root / "learner" / "weights", root):
        found = {int(p.name[1:]): p for p in weights.glob("v*") if p.name[1:].isdigit() and p.is_dir()}
        if found:
            return weights, found
    raise FileNotFoundError(f"{run_dir}: no published versions (v<N>/) in it, in weights/ or in learner/weights/")


def export_version(src: str | Path, out: str | Path, merge: bool = False, base: str | Path | None = None) -> Path:
    """Write version directory ``src`` as a Hugging Face directory at ``out`` that
    ``AutoModelForCausalLM.from_pretrained(out)`` loads as is: full weights as they are; a LoRA
    adapter (``base``: the base it applies to) as PEFT's files naming that base, or with
    ``merge`` the base with the adapter merged in (PEFT's ``merge_and_unload``), and the
    tokenizer."""
    import json
    import shutil

    src, out = Path(src), Path(out)
    if not (src / ADAPTER_CONFIG).is_file():
        shutil.copytree(src, out, dirs_exist_ok=True)  # full weights (merge: nothing to merge)
        return out
    if base is None or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"{src} is a LoRA adapter, but its base ({base}) has no config.json")
    base = Path(base).resolve()
    _, tokenizer = load_policy(str(base))
    if merge:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype="auto")
        merged = PeftModel.from_pretrained(model, str(src)).merge_and_unload()
        merged.save_pretrained(out, safe_serialization=True)
    else:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "adapter_model.safetensors", out / "adapter_model.safetensors")
        config = json.loads((src / ADAPTER_CONFIG).read_text())
        config["base_model_name_or_path"] = str(base)  # where transformers finds the base
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    return out
