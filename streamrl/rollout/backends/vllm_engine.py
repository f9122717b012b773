"""``VLLMBackend``: vLLM's offline engine on the worker's GPU (the ``[vllm]`` extra), loading new
versions in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from streamrl.rollout.backends.base import Completion, PromptInput, SamplingParams
from streamrl.rollout.backends.local import _LocalEngine
from streamrl.weights import iter_safetensors, weights_path


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
        self._lora: Any = None  # LoRA: the LoRARequest of the version in use
        self._lora_ids = 0
        self._base: str | None = None  # LoRA: the base_uri loaded

    def _generate(self, prompts: list[PromptInput], n: int, params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VLLMSamplingParams(n=n, temperature=max(params.temperature, 0.0), top_p=params.top_p,
                                max_tokens=params.max_new_tokens, logprobs=0, ignore_eos=params.ignore_eos)
        inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
        results = []
        for request in self.llm.generate(inputs, sp, use_tqdm=False, lora_request=self._lora):
            samples = []
            for c in request.outputs:
                ids = list(c.token_ids)
                lps = np.array([c.logprobs[k][t].logprob for k, t in enumerate(ids)], dtype=np.float32)
                samples.append(Completion(text=c.text, prompt_ids=list(request.prompt_token_ids),
                                          response_ids=ids, response_logprobs=lps,
                                          finish_reason="length" if c.finish_reason == "length" else "stop",
                                          policy_version=0))
            results.append(samples)
        return results

    def _load_weights(self, uri: str, base_uri: str | None = None) -> None:
        """Full weights in place; a LoRA version (``base_uri``): the base in place once, then the
        adapter as a ``LoRARequest`` named per version that the next generations carry (the
        engine needs ``rollout.vllm.engine_kwargs: {enable_lora: true, max_lora_rank: R}``)."""
        if base_uri is not None:
            from vllm.lora.request import LoRARequest

            if self._base != base_uri:
                self.llm.collective_rpc(_vllm_worker_load, args=(str(weights_path(base_uri)),))
                self.llm.reset_prefix_cache()
                self._base = base_uri
            old = self._lora
            self._lora = LoRARequest(f"streamrl-{self._lora_ids + 1}", self._lora_ids + 1, str(weights_path(uri)))
            self._lora_ids += 1
            if old is not None:  # no batch runs now (loads fall between batches): nothing names it
                self.llm.llm_engine.remove_lora(old.lora_int_id)
            return
        self._lora, self._base = None, None
        path = str(weights_path(uri))
        self.llm.collective_rpc(_vllm_worker_load, args=(path,))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights


def _vllm_worker_load(worker: Any, path: str) -> None:
    """Runs inside each vLLM worker process (``LLM.collective_rpc``); a quantised engine
    (``rollout.quantization``) quantises the full-precision version again as it loads it
    (``streamrl.rollout.vllm_extension.load_into``)."""
    from streamrl.rollout.vllm_extension import load_into

    load_into(worker.model_runner, iter_safetensors(Path(path)))
