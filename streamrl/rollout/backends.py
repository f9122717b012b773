"""Generation backends behind one interface: prompts in, ``n`` samples each out, with token ids
and the behaviour policy's log-probs.

- ``TransformersBackend``: a Hugging Face causal LM on CPU or CUDA (the tests' tiny model).
- ``VLLMBackend``: vLLM's offline engine on the worker's GPU (the ``[vllm]`` extra).
- ``OpenAIBackend``: any OpenAI-compatible ``/v1/completions`` server (``vllm serve``, SGLang,
  hosted models) over aiohttp.

A prompt is text or token ids. Token ids are what multi-turn needs: the worker extends the
context token by token (response, then feedback), so the learner sees exactly the sequence the
policy was conditioned on, never a re-tokenisation of text. A backend with a ``tokenizer``
accepts both; the OpenAI backend has none and works on text (token ids come back when the
server can report them).

``response_logprobs`` (fp32) are the log-probabilities of the sampled tokens under the model's
distribution at the sampling temperature, ``log_softmax(logits / T)``, before top-p truncation
(at T = 0, greedy, under ``log_softmax(logits)``): what a learner recomputes with the same
temperature. vLLM and OpenAI-compatible servers report theirs (vLLM: see its ``logprobs_mode``).

An in-process engine (transformers, vLLM) runs one batch at a time and merges the requests that
wait meanwhile into the next batch; weight loads fall between batches. A rollout worker is one
engine; scale by running more workers.
"""

from __future__ import annotations

import asyncio
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import orjson

PromptInput = str | list[int]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0


@dataclass
class Sample:
    """One sampled response. Token fields are None when the backend cannot report them (a
    text-only server)."""

    text: str
    prompt_ids: list[int] | None
    response_ids: list[int] | None
    response_logprobs: np.ndarray | None  # float32, one per response token
    finish_reason: str  # "stop" (end of sequence) | "length" (max_new_tokens)
    policy_version: int  # the weights that produced it


class BackendError(Exception):
    """The backend refused this request for good (e.g. the prompt is too long): the prompt
    goes to dead letters with this message."""


class BackendUnavailable(Exception):
    """The backend cannot be reached right now (connection refused, 5xx, timeouts after
    retries): the worker holds the prompt and tries again; nothing is dropped or faked."""


class WeightLoadError(Exception):
    """A policy version's weights could not be loaded; the worker keeps the weights it has."""


def weights_path(uri: str) -> Path:
    """A ``weights_uri`` as a local directory: a path (optionally ``file://``) as it is; any other
    URI (``s3://``, ``gs://``, ...: ``learner.weights_uri``) downloaded first with fsspec, into a
    directory of this process that ``load_weights`` removes once loaded (``streamrl.weights_store``)."""
    from streamrl import weights_store

    if weights_store.is_remote(uri):
        try:
            return weights_store.download(uri)
        except Exception as exc:  # the filesystem's own errors (missing, denied, no s3fs ...)
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise WeightLoadError(f"weights {uri!r}: cannot download: {why}") from exc
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise WeightLoadError(f"weights {uri!r}: not a directory here")
    return path


def iter_safetensors(directory: Path):
    """``(name, tensor)`` of every ``*.safetensors`` file in ``directory`` (safetensors holds
    only tensors: nothing in it is executed)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{directory}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class Backend(ABC):
    """What a rollout worker samples from."""

    name: str = "backend"
    tokenizer: Any = None  # a Hugging Face tokenizer, when the backend works on token ids
    can_load_weights: bool = True

    def __init__(self) -> None:
        self.version = 0  # the policy version of the weights in use

    @abstractmethod
    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Sample]]:
        """``n`` samples for each prompt, in order."""

    async def load_weights(self, uri: str, version: int) -> float:
        """Load a policy version between generations; returns the seconds it took."""
        raise WeightLoadError(f"the {self.name} backend cannot load weights")

    async def close(self) -> None:
        return None


@dataclass
class _Request:
    prompts: list[PromptInput]
    n: int
    params: SamplingParams
    future: asyncio.Future


class _LocalEngine(Backend):
    """A backend whose engine runs in this process. Generation runs in a thread (the event loop
    keeps the consumer group's heartbeats going), one batch at a time; requests that arrive
    while a batch runs are merged into the next one (same ``n`` and sampling parameters, up to
    ``max_batch_rows`` sequences), so a worker with several prompts in flight fills the engine.
    A weight load waits for the batch in progress and runs before the next."""

    def __init__(self, max_batch_rows: int = 64) -> None:
        super().__init__()
        self.max_batch_rows = max_batch_rows
        self.batches = 0  # engine calls so far
        self._lock = asyncio.Lock()
        self._queue: list[_Request] = []
        self._server: asyncio.Task | None = None

    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Sample]]:
        if any(len(p) == 0 for p in prompts):
            raise BackendError("empty prompt")
        request = _Request(list(prompts), n, params, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        if self._server is None or self._server.done():
            self._server = asyncio.create_task(self._serve())
        return await request.future

    async def _serve(self) -> None:
        while self._queue:
            async with self._lock:
                batch = self._take()
                if not batch:
                    continue
                version = self.version
                try:
                    out = await asyncio.to_thread(self._generate, [p for r in batch for p in r.prompts],
                                                  batch[0].n, batch[0].params)
                except Exception as exc:  # noqa: BLE001 - handed to every caller in the batch
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                self.batches += 1
            for samples in out:
                for s in samples:
                    s.policy_version = version
            start = 0
            for r in batch:
                if not r.future.done():  # a caller that was cancelled meanwhile
                    r.future.set_result(out[start:start + len(r.prompts)])
                start += len(r.prompts)

    def _take(self) -> list[_Request]:
        """The oldest request and the queued ones that can share its engine call."""
        self._queue = [r for r in self._queue if not r.future.done()]
        if not self._queue:
            return []
        first, batch, rows = self._queue[0], [], 0
        for r in list(self._queue):
            if (r.n, r.params) != (first.n, first.params):
                continue
            if batch and rows + len(r.prompts) * r.n > self.max_batch_rows:
                break
            batch.append(r)
            rows += len(r.prompts) * r.n
            self._queue.remove(r)
        return batch

    async def load_weights(self, uri: str, version: int) -> float:
        async with self._lock:
            started = time.monotonic()
            try:
                await asyncio.to_thread(self._load_weights, uri)
            finally:
                from streamrl import weights_store

                weights_store.release(uri)  # a downloaded copy is not needed once loaded
            self.version = version
            return time.monotonic() - started

    @abstractmethod
    def _generate(self, prompts: list[PromptInput], n: int, params: SamplingParams) -> list[list[Sample]]:
        ...

    @abstractmethod
    def _load_weights(self, uri: str) -> None:
        ...


class TransformersBackend(_LocalEngine):
    """``model.generate`` on a Hugging Face causal LM (``streamrl.policy.load_policy``)."""

    name = "transformers"

    def __init__(self, policy: str = "tiny", device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 max_batch_rows: int = 64):
        super().__init__(max_batch_rows)
        import torch

        from streamrl.policy import load_policy

        self.model, self.tokenizer = load_policy(policy, device=device, dtype=dtype, seed=seed)
        self.tokenizer.padding_side = "left"
        self.device = device
        torch.manual_seed(seed)

    def _generate(self, prompts: list[PromptInput], n: int, params: SamplingParams) -> list[list[Sample]]:
        import torch

        tok = self.tokenizer
        prompt_ids = [p if isinstance(p, list) else tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        batch = tok.pad({"input_ids": prompt_ids}, return_tensors="pt")
        input_ids = batch["input_ids"].repeat_interleave(n, 0).to(self.device)
        attention = batch["attention_mask"].repeat_interleave(n, 0).to(self.device)
        greedy = params.temperature <= 0
        sampling = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p}
        recorder = _logprob_recorder(1.0 if greedy else params.temperature)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention, do_sample=not greedy,
                max_new_tokens=params.max_new_tokens, return_dict_in_generate=True,
                logits_processor=[recorder], pad_token_id=tok.pad_token_id, **sampling)
            new = out.sequences[:, input_ids.shape[1]:]
            logprobs = recorder.finish(new)
        new, logprobs = new.cpu().tolist(), logprobs.cpu().numpy().astype(np.float32)
        eos = tok.eos_token_id
        results: list[list[Sample]] = []
        for i, ids in enumerate(prompt_ids):
            samples = []
            for j in range(i * n, (i + 1) * n):
                resp = new[j]
                stop = eos in resp
                length = resp.index(eos) + 1 if stop else len(resp)
                resp = resp[:length]
                samples.append(Sample(text=tok.decode(resp, skip_special_tokens=True),
                                      prompt_ids=list(ids), response_ids=resp,
                                      response_logprobs=logprobs[j, :length].copy(),
                                      finish_reason="stop" if stop else "length", policy_version=0))
            results.append(samples)
        return results

    def _load_weights(self, uri: str) -> None:
        """Copy the version's tensors into the running model (no second model in memory)."""
        import torch

        state = dict(iter_safetensors(weights_path(uri)))
        with torch.no_grad():
            result = self.model.load_state_dict(state, strict=False)
        missing = set(result.missing_keys)
        out_emb, in_emb = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if out_emb is not None and out_emb.weight is in_emb.weight:
            missing.discard("lm_head.weight")  # tied to the input embeddings, saved once
        if missing or result.unexpected_keys:
            raise WeightLoadError(f"weights {uri!r} do not fit the model: missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(result.unexpected_keys)[:5]}")


def _logprob_recorder(temperature: float):
    """A logits processor that records ``log_softmax(logits / T)`` at each sampled token, one
    step late (at step t it sees the token sampled at t - 1), so it keeps one [batch, vocab] row
    of log-probs instead of the [batch, steps, vocab] that ``output_logits`` would hold: the
    difference between a few MB and tens of GB for a large vocabulary and long responses.
    ``generate`` runs custom processors before its temperature / top-p warpers, so the
    recorded distribution is the temperature-scaled one, untruncated."""
    import torch
    from transformers import LogitsProcessor

    class Recorder(LogitsProcessor):
        def __init__(self) -> None:
            self.steps: list[torch.Tensor] = []
            self.pending: torch.Tensor | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.pending is not None:
                self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.pending = torch.log_softmax(scores.float() / temperature, dim=-1)
            return scores

        def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
            """[batch, steps] log-probs of ``new_tokens`` (the generated part)."""
            if self.pending is not None:
                self.steps.append(self.pending.gather(-1, new_tokens[:, -1:]).squeeze(-1))
                self.pending = None
            return torch.stack(self.steps, dim=1)

    return Recorder()


class VLLMBackend(_LocalEngine):
    """vLLM's offline engine (``pip install streamrl[vllm]``; needs a GPU, so the tests here
    cannot run it). New versions are loaded in place: each engine worker reads the version's
    safetensors files itself and calls the model's own ``load_weights``, so no tensor crosses a
    process boundary and the KV cache and CUDA graphs are kept."""

    name = "vllm"

    def __init__(self, policy: str, dtype: str = "auto", seed: int = 0, gpu_memory_utilization: float = 0.85,
                 tensor_parallel_size: int = 1, engine_kwargs: dict[str, Any] | None = None,
                 max_batch_rows: int = 1024):
        super().__init__(max_batch_rows)
        from streamrl.errors import need

        LLM = need("vllm", "vllm", "rollout backend 'vllm'").LLM
        self.llm = LLM(model=policy, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       tensor_parallel_size=tensor_parallel_size, **(engine_kwargs or {}))
        self.tokenizer = self.llm.get_tokenizer()

    def _generate(self, prompts: list[PromptInput], n: int, params: SamplingParams) -> list[list[Sample]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VLLMSamplingParams(n=n, temperature=max(params.temperature, 0.0), top_p=params.top_p,
                                max_tokens=params.max_new_tokens, logprobs=0)
        inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
        results = []
        for request in self.llm.generate(inputs, sp, use_tqdm=False):
            samples = []
            for c in request.outputs:
                ids = list(c.token_ids)
                lps = np.array([c.logprobs[k][t].logprob for k, t in enumerate(ids)], dtype=np.float32)
                samples.append(Sample(text=c.text, prompt_ids=list(request.prompt_token_ids),
                                      response_ids=ids, response_logprobs=lps,
                                      finish_reason="length" if c.finish_reason == "length" else "stop",
                                      policy_version=0))
            results.append(samples)
        return results

    def _load_weights(self, uri: str) -> None:
        path = str(weights_path(uri))
        self.llm.collective_rpc(_vllm_worker_load, args=(path,))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights


def _vllm_worker_load(worker: Any, path: str) -> None:
    """Runs inside each vLLM worker process (``LLM.collective_rpc``)."""
    worker.model_runner.model.load_weights(iter_safetensors(Path(path)))


class OpenAIBackend(Backend):
    """``POST {server}/v1/completions`` with ``logprobs``; ``n`` samples in one request per
    prompt, requests for different prompts in parallel, over a fleet of servers
    (``streamrl.rollout.fleet``: least outstanding requests, health ejection, per-server
    limits). The API key is read from the environment variable ``api_key_env`` names, and only
    ever sent in the header.

    With ``update_api`` sglang or vllm the fleet follows the learner (``load_weights`` has every
    server load the version) and each sample carries the version its server had when the
    request started. With ``none`` (a hosted model) the servers own their weights:
    ``can_load_weights`` is False and samples are stamped version 0."""

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key_env: str = "", timeout_s: float = 300.0,
                 max_retries: int = 4, token_ids: bool = True, *, servers: Sequence[str] = (),
                 update_api: str = "none", on_update: str = "drain",
                 **fleet: Any):
        super().__init__()
        from streamrl.rollout.fleet import ServerFleet

        self.model, self.timeout_s, self.max_retries = model, timeout_s, max_retries
        self.token_ids = token_ids
        key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.can_load_weights = update_api != "none"
        if update_api == "none":  # a hosted API has no /health: never eject, as before fleets
            fleet = {**fleet, "health_interval_s": 0.0, "eject_after": 1 << 30}
        self.fleet = ServerFleet(list(servers) or [base_url], update_api=update_api, on_update=on_update,
                                 headers=self._headers, **fleet)
        self._session = None

    @property
    def url(self) -> str:
        return next(iter(self.fleet.members.values())).completions_url

    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Sample]]:
        await self._ensure_session()
        return list(await asyncio.gather(*(self._complete(p, n, params) for p in prompts)))

    async def load_weights(self, uri: str, version: int) -> float:
        """Start every server loading ``version`` (the fleet does it in the background, server by
        server as each drains or aborts); returns at once: requests meanwhile go to servers on a
        version the staleness bound allows. Each server's load time is
        ``streamrl_rollout_server_update_seconds``."""
        from streamrl import weights_store

        if weights_store.is_remote(uri):  # the servers read a path; they cannot fetch s3:// etc.
            raise WeightLoadError(f"weights {uri!r}: inference servers load from a path they see; "
                                  "put learner.weights_dir on a volume the servers mount")
        await self._ensure_session()
        self.fleet.follow(uri, version)
        self.version = version
        return 0.0

    async def _ensure_session(self) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            await self.fleet.start(self._session)

    async def close(self) -> None:
        await self.fleet.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """The answer and the policy version of the server that gave it. Connection errors,
        429 and 5xx are retried (on another server where there is one) with exponential
        backoff; a request aborted for a weight update is resubmitted without counting as a
        retry."""
        import aiohttp

        from streamrl.scorers.base import ScorerUnavailable
        from streamrl.scorers.router import RouterError

        payload = orjson.dumps(body)
        headers = {**self._headers, "Content-Type": "application/json"}
        tried: list[str] = []
        attempt, last = 0, ""
        while True:
            try:
                async with self.fleet.lease(tried, wait_s=self.timeout_s) as (server, version):
                    tried.append(server.url)
                    url = server.completions_url
                    task = asyncio.create_task(self._post_once(url, payload, headers))
                    server.inflight.add(task)
                    try:
                        await asyncio.wait({task})
                    finally:
                        server.inflight.discard(task)
                        if not task.done():  # this caller was cancelled: so is its request
                            task.cancel()
                    if task.cancelled():  # aborted for a weight update: resubmit, as if not sent
                        self.fleet.aborted += 1
                        from streamrl import metrics

                        metrics.ROLLOUT_REQUESTS_ABORTED.inc()
                        tried.pop()
                        continue
                    return task.result(), version
            except (RouterError, asyncio.TimeoutError, aiohttp.ClientError) as exc:  # one server failed
                last = str(exc)
            except ScorerUnavailable as exc:  # none to pick (RouterError is one too: caught above)
                raise BackendUnavailable(f"no rollout server available: {exc}") from None
            attempt += 1
            if attempt > self.max_retries:
                raise BackendUnavailable(f"{len(tried)} attempts failed, last: {last}")
            await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 10.0))

    async def _post_once(self, url: str, payload: bytes, headers: dict[str, str]) -> dict[str, Any]:
        from streamrl.scorers.router import RouterError

        async with self._session.post(url, data=payload, headers=headers) as resp:
            text = await resp.text()
            if resp.status == 429 or resp.status >= 500:
                raise RouterError(f"http_{'429' if resp.status == 429 else '5xx'}", f"HTTP {resp.status}: {text[:200]}")
            if resp.status >= 400:
                raise BackendError(f"{url}: HTTP {resp.status}: {text[:500]}")
            try:
                return orjson.loads(text)
            except orjson.JSONDecodeError:
                raise BackendError(f"{url}: response is not JSON: {text[:200]}") from None

    async def _complete(self, prompt: PromptInput, n: int, params: SamplingParams) -> list[Sample]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "n": n,
                                "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "logprobs": 0}
        if self.token_ids:
            body["return_token_ids"] = True  # vLLM: choices[].token_ids / prompt_token_ids
            body["return_tokens_as_token_ids"] = True  # vLLM: logprobs tokens as "token_id:N"
        data, version = await self._post(body)
        try:
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
            samples = [self._sample(c, prompt) for c in choices]
            for sample in samples:
                sample.policy_version = version
            return samples
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendError(f"{self.url}: unexpected response shape ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def _sample(choice: dict[str, Any], prompt: PromptInput) -> Sample:
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        ids = choice.get("token_ids")
        if ids is None and lp.get("tokens") and all(str(t).startswith("token_id:") for t in lp["tokens"]):
            ids = [int(str(t).removeprefix("token_id:")) for t in lp["tokens"]]
        prompt_ids = prompt if isinstance(prompt, list) else choice.get("prompt_token_ids")
        return Sample(text=str(choice["text"]),
                      prompt_ids=None if prompt_ids is None else [int(t) for t in prompt_ids],
                      response_ids=None if ids is None else [int(t) for t in ids],
                      response_logprobs=None if logprobs is None else np.asarray(
                          [float(x) for x in logprobs], dtype=np.float32),
                      finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
                      policy_version=0)


def make_backend(cfg) -> Backend:
    """The backend a ``RolloutConfig`` names."""
    if cfg.backend == "transformers":
        return TransformersBackend(cfg.policy, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                                   max_batch_rows=cfg.max_batch_rows or 64)
    if cfg.backend == "vllm":
        v = cfg.vllm
        return VLLMBackend(cfg.policy, dtype=cfg.dtype, seed=cfg.seed, gpu_memory_utilization=v.gpu_memory_utilization,
                           tensor_parallel_size=v.tensor_parallel_size, engine_kwargs=dict(v.engine_kwargs),
                           max_batch_rows=cfg.max_batch_rows or 1024)
    if cfg.backend == "openai":
        o = cfg.openai
        return OpenAIBackend(o.base_url, o.model, api_key_env=o.api_key_env, timeout_s=o.timeout_s,
                             max_retries=o.max_retries, token_ids=o.token_ids, servers=list(cfg.servers),
                             update_api=cfg.resolved_update_api(), on_update=cfg.on_update,
                             max_requests_per_server=o.max_requests_per_server,
                             update_timeout_s=o.update_timeout_s, update_retry_s=o.update_retry_s,
                             update_retry_max_s=o.update_retry_max_s, health_interval_s=o.health_interval_s,
                             eject_after=o.eject_after)
    raise ValueError(f"unknown backend {cfg.backend!r}")
