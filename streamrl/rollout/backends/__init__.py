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

The interface is in ``base``; the engines in ``transformers_engine``, ``vllm_engine`` and
``openai_server``; ``streamrl.weights`` turns an announced ``weights_uri`` into tensors.
"""

from __future__ import annotations

from streamrl.rollout.backends.base import (Backend, BackendError, BackendUnavailable, PromptInput, Completion,
                                            SamplingParams, WeightLoadError)

__all__ = ["Backend", "BackendError", "BackendUnavailable", "PromptInput", "Completion", "SamplingParams",
           "WeightLoadError", "make_backend", "engine_kwargs"]


def engine_kwargs(cfg) -> dict:
    """``vllm.LLM``'s arguments beyond the backend's own: ``rollout.vllm.engine_kwargs``, with the
    policy's config overrides (``rollout.override_config``) as ``hf_overrides`` and its
    quantisation (``rollout.quantization``) as ``quantization`` (its config file as
    ``hf_overrides.quantization_config_file``, where vLLM reads it)."""
    from streamrl.policy import model_overrides

    out = dict(cfg.vllm.engine_kwargs)
    overrides = model_overrides(cfg.override_config)
    if cfg.quantization:
        out["quantization"] = cfg.quantization
    if cfg.quantization_config_file:
        overrides = {**overrides, "quantization_config_file": cfg.quantization_config_file}
    if overrides:
        out["hf_overrides"] = {**overrides, **dict(out.get("hf_overrides") or {})}
    return out


def make_backend(cfg) -> Backend:
    """The backend a ``RolloutConfig`` names."""
    from streamrl.policy import model_overrides

    if cfg.backend == "transformers":
        from streamrl.rollout.backends.transformers_engine import TransformersBackend
    elif cfg.backend == "vllm":
        from streamrl.rollout.backends.vllm_engine import VLLMBackend
    elif cfg.backend == "openai":
        from streamrl.rollout.backends.openai_server import OpenAIBackend
    if cfg.backend == "transformers":
        backend = TransformersBackend(cfg.policy, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                                      max_batch_rows=cfg.max_batch_rows or 64,
                                      overrides=model_overrides(cfg.override_config),
                                      return_routed_experts=cfg.return_routed_experts)
        if cfg.on_update == "partial":
            backend.partial_chunk = cfg.partial_chunk_tokens
        return backend
    if cfg.backend == "vllm":
        v = cfg.vllm
        return VLLMBackend(cfg.policy, dtype=cfg.dtype, seed=cfg.seed, gpu_memory_utilization=v.gpu_memory_utilization,
                           tensor_parallel_size=v.tensor_parallel_size, engine_kwargs=engine_kwargs(cfg),
                           max_batch_rows=cfg.max_batch_rows or 1024)
    if cfg.backend == "openai":
        o = cfg.openai
        return OpenAIBackend(o.base_url, o.model, api_key_env=o.api_key_env, timeout_s=o.timeout_s,
                             max_retries=o.max_retries, token_ids=o.token_ids, servers=list(cfg.servers),
                             update_api=cfg.resolved_update_api(), on_update=cfg.on_update,
                             max_requests_per_server=o.max_requests_per_server,
                             update_timeout_s=o.update_timeout_s, update_retry_s=o.update_retry_s,
                             update_retry_max_s=o.update_retry_max_s, health_interval_s=o.health_interval_s,
                             eject_after=o.eject_after, started_on=o.started_on or None,
                             pause_on_update=o.pause_on_update, stream_timeout_s=o.stream_timeout_s,
                             follow_policy=cfg.follow_policy, return_routed_experts=cfg.return_routed_experts,
                             route_shape=_route_shape(cfg.policy) if cfg.return_routed_experts else None)
    raise ValueError(f"unknown backend {cfg.backend!r}")


def _route_shape(policy: str) -> tuple[int, int] | None:
    """``(layers, topk)`` of the MoE model at ``policy`` (a directory with its config.json), for
    SGLang's flat routed experts; None where the policy is not a directory."""
    import json
    from pathlib import Path

    path = Path(str(policy).removeprefix("file://")) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    config = config.get("text_config", config)
    if "num_hidden_layers" not in config or "num_experts_per_tok" not in config:
        return None
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])
