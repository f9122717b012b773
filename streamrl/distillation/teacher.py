"""The teacher: given a trajectory's token ids, its log-probs at each response token: of the
sampled token (``topk`` 0, the KL-estimator losses), or its ``topk`` most likely tokens and their
ids (``forward_kl_topk``). Two backends behind one ``Teacher`` protocol:

- ``TransformersTeacher``: a local model (transformers), one forward pass over ``prompt +
  response`` per batch of records, in a thread so the stage's Kafka client keeps its membership;
- ``OpenAITeacher``: a fleet of OpenAI-compatible servers (vLLM) asked for ``prompt_logprobs`` on
  the token ids with ``max_tokens`` 1, spread over the servers by the reward group's router
  (health checks, ejection, retries on another server; verl's teacher loop asks its vLLM /
  SGLang servers the same way).

A record the teacher cannot annotate raises ``Failure`` with a reason (``no_tokens``,
``bad_tokens``, ``teacher_error``); the stage dead-letters it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from streamrl import metrics
from streamrl.distillation.config import TeacherConfig
from streamrl.errors import Failure
from streamrl.policy import load_policy
from streamrl.weights import local_policy
from streamrl.records import Trajectory
from streamrl.scorers.batching import MicroBatcher


@dataclass
class Annotation:
    """The teacher's log-probs for one record's response: ``[R]`` (topk 0) or ``[R, K]`` with
    ``ids`` ``[R, K]``, largest first."""

    logprobs: np.ndarray
    ids: np.ndarray | None


class Teacher(Protocol):
    backend: str

    async def start(self) -> None: ...

    async def annotate(self, prompt_ids: np.ndarray, response_ids: np.ndarray) -> Annotation: ...

    async def close(self) -> None: ...


def token_ids(record: Trajectory) -> tuple[np.ndarray, np.ndarray]:
    """The record's prompt and response ids, or ``Failure("no_tokens")``: the teacher scores the
    student's own tokens (the two share a tokenizer, as in verl)."""
    prompt, response = record.array("prompt_ids"), record.array("response_ids")
    if prompt is None or response is None or len(prompt) == 0:
        raise Failure("no_tokens", "the teacher needs prompt_ids and response_ids (a text-only record cannot be "
                                   "distilled)")
    return prompt.astype(np.int64), response.astype(np.int64)


class TransformersTeacher:
    """A local teacher model; records are batched (``teacher.batch_size`` / ``batch_wait_ms``)
    into one padded forward pass."""

    backend = "transformers"

    def __init__(self, cfg: TeacherConfig, topk: int):
        self.cfg, self.topk = cfg, topk
        self.model: Any = None
        self.tokenizer: Any = None
        self.vocab = 0
        self.batcher = MicroBatcher(self._run, cfg.batch_size, cfg.batch_wait_ms / 1000)

    def load(self) -> None:
        """Load the model now (at build: a missing model fails before anything connects)."""
        self.model, self.tokenizer = load_policy(local_policy(self.cfg.model), device=self.cfg.device,
                                                 dtype=self.cfg.dtype, seed=self.cfg.seed)  # (a delta: rebuilt first)
        self.model.eval()
        self.vocab = self.model.get_input_embeddings().num_embeddings

    async def start(self) -> None:
        if self.model is None:
            await asyncio.to_thread(self.load)

    async def close(self) -> None:
        await self.batcher.close()

    async def annotate(self, prompt_ids: np.ndarray, response_ids: np.ndarray) -> Annotation:
        for name, ids in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
            if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab):
                raise Failure("bad_tokens", f"{name} outside the teacher's vocabulary (size {self.vocab})")
        return await self.batcher.submit((prompt_ids, response_ids))

    async def _run(self, batch: list[tuple[np.ndarray, np.ndarray]]) -> list[Annotation]:
        started = time.perf_counter()
        out = await asyncio.to_thread(self.forward, batch)
        metrics.TEACHER_BATCH_SECONDS.labels(self.backend).observe(time.perf_counter() - started)
        metrics.TEACHER_BATCH_SIZE.labels(self.backend).observe(len(batch))
        return out

    def forward(self, batch: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Annotation]:
        """One padded forward pass; the logits at ``len(prompt) - 1 + j`` predict response token j."""
        import torch

        lengths = [len(p) + len(r) for p, r in batch]
        ids = torch.zeros((len(batch), max(lengths)), dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, (p, r) in enumerate(batch):
            ids[i, :lengths[i]] = torch.from_numpy(np.concatenate([p, r]))
            attention[i, :lengths[i]] = 1
        device = self.cfg.device
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits.float()
        out = []
        for i, (p, r) in enumerate(batch):
            rows = logits[i, len(p) - 1:len(p) - 1 + len(r)] / self.cfg.temperature
            logp = torch.log_softmax(rows, -1)
            if self.topk:
                top = torch.topk(logp, min(self.topk, logp.shape[-1]), -1)
                out.append(Annotation(top.values.cpu().numpy().astype(np.float32), top.indices.cpu().numpy()))
            else:
                picked = logp.gather(-1, torch.from_numpy(r).to(logp.device).unsqueeze(-1)).squeeze(-1)
                out.append(Annotation(picked.cpu().numpy().astype(np.float32), None))
        return out


class OpenAITeacher:
    """Teacher servers speaking the OpenAI completions API with vLLM's ``prompt_logprobs``: the
    prompt is the token ids (``prompt + response``), ``max_tokens`` 1; each server answers, for
    every prompt token, the sampled token's log-prob and the top ``prompt_logprobs``. The reward
    group's router spreads the requests (least outstanding, health checks on ``/health``,
    ejection, another server on a retry); every server down is ``Unavailable``: the stage holds
    the record, never drops it."""

    backend = "openai"

    def __init__(self, cfg: TeacherConfig, topk: int):
        from streamrl.servers.router import Router

        self.cfg, self.topk = cfg, topk
        self.router = Router(urls=list(cfg.servers), name="teacher")
        self.session: Any = None

    async def start(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        await self.router.start(self.session)

    async def close(self) -> None:
        await self.router.close()
        if self.session is not None:
            await self.session.close()

    async def annotate(self, prompt_ids: np.ndarray, response_ids: np.ndarray) -> Annotation:
        import orjson

        body = orjson.dumps({"model": self.cfg.model, "max_tokens": 1, "temperature": 1.0,
                             "prompt": [int(t) for t in np.concatenate([prompt_ids, response_ids])],
                             "prompt_logprobs": self.topk})
        started = time.perf_counter()
        out = await self.router.post_json(
            "/v1/completions", body, headers={"Content-Type": "application/json"},
            parse=lambda answer: parse_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], prompt_ids,
                                                       response_ids, self.topk),
            max_retries=self.cfg.max_attempts - 1, backoff_s=0.05, backoff_max_s=2.0, rejected="teacher_rejected")
        metrics.TEACHER_BATCH_SECONDS.labels(self.backend).observe(time.perf_counter() - started)
        metrics.TEACHER_BATCH_SIZE.labels(self.backend).observe(1)
        return out


def parse_prompt_logprobs(entries: list[Any], prompt_ids: np.ndarray, response_ids: np.ndarray,
                          topk: int) -> Annotation:
    """vLLM's ``prompt_logprobs`` (one ``{token_id: {logprob, rank}}`` per prompt token, None for
    the first) as the response tokens' annotation: the sampled token's log-prob, or the ``topk``
    largest (the sampled token, always included by vLLM, is left out unless it ranks within k)."""
    p, r = len(prompt_ids), len(response_ids)
    if len(entries) != p + r:
        raise Failure("teacher_error", f"{len(entries)} prompt_logprobs for {p + r} tokens")
    logprobs, ids = [], []
    for j in range(r):
        entry = {int(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in entries[p + j].items()}
        if not topk:
            logprobs.append(entry[int(response_ids[j])])
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:topk]
        if len(ranked) < topk:
            raise Failure("teacher_error", f"{len(ranked)} prompt_logprobs at token {j}, top-{topk} asked")
        ids.append([k for k, _ in ranked])
        logprobs.append([v for _, v in ranked])
    return Annotation(np.asarray(logprobs, np.float32), np.asarray(ids, np.int64) if topk else None)


def check_tokenizer(teacher: Any, cfg: TeacherConfig, name: str, student: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's (``student``: its policy spec),
    naming both: its log-probs are per token of the student's response and its top-k ids are
    token ids, so they mean something only over the student's tokens (verl's teacher reads the
    student's token ids as they are too). The transformers backend's tokenizer is the one it
    loaded; a server fleet's is read from ``teacher.model`` where that is a local directory
    (a hub name served remotely cannot be read here, and is taken as the student's)."""
    from pathlib import Path

    from streamrl.errors import ConfigError
    from streamrl.policy import TINY_SPEC, load_tokenizer

    if not student:
        return
    mine = getattr(teacher, "tokenizer", None)
    if mine is None:
        spec = cfg.model.removeprefix("file://")
        if not (cfg.model == TINY_SPEC or Path(spec).is_dir()):
            return
        mine = load_tokenizer(cfg.model)
    theirs = load_tokenizer(student)
    if len(mine) != len(theirs) or mine.get_vocab() != theirs.get_vocab():
        raise ConfigError(f"config field 'distillation.teacher_models.{name}.model_path' ({cfg.model}): the teacher's "
                          f"tokenizer ({len(mine)} tokens) is not the student's (learner.policy {student}, "
                          f"{len(theirs)} tokens): distillation reads the teacher's log-probs over the student's tokens"
                          if name != "teacher" else
                          f"config field 'teacher.model' ({cfg.model}): the teacher's tokenizer ({len(mine)} tokens) is "
                          f"not the student's (learner.policy {student}, {len(theirs)} tokens): distillation reads the "
                          f"teacher's log-probs over the student's tokens")


def build_teacher(cfg: TeacherConfig, topk: int) -> Teacher:
    return TransformersTeacher(cfg, topk) if cfg.backend == "transformers" else OpenAITeacher(cfg, topk)
