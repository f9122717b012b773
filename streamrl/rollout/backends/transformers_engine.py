"""``TransformersBackend``: ``model.generate`` on a Hugging Face causal LM in this process (CPU or
CUDA; the tests' tiny model), with the sampled tokens' log-probs recorded as it samples."""

from __future__ import annotations

import contextlib

import numpy as np

from streamrl.rollout.backends.base import Completion, PromptInput, SamplingParams, WeightLoadError
from streamrl.rollout.backends.local import _LocalEngine
from streamrl.routing import generated_routes
from streamrl.weights import iter_safetensors, weights_path


class TransformersBackend(_LocalEngine):
    """``model.generate`` on a Hugging Face causal LM (``streamrl.policy.load_policy``)."""

    name = "transformers"

    def __init__(self, policy: str = "tiny", device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 max_batch_rows: int = 64, overrides: dict | None = None, return_routed_experts: bool = False):
        """``return_routed_experts``: each completion carries the experts its tokens were routed
        to (``streamrl.routing.RouterTap`` on the model's routers; refused for a dense model)."""
        super().__init__(max_batch_rows)
        import torch

        from streamrl.policy import load_policy

        self.model, self.tokenizer = load_policy(policy, device=device, dtype=dtype, seed=seed, overrides=overrides,
                                                 where="rollout.override_config")
        self.tokenizer.padding_side = "left"
        self.device = device
        self._base: str | None = None  # LoRA: the base_uri whose weights the model holds
        self._adapter_shape: tuple | None = None  # LoRA: the adapter injected (rank, targets ...)
        self.tap = None
        if return_routed_experts:
            from streamrl.errors import ConfigError
            from streamrl.routing import RouterTap, RoutingError

            try:
                self.tap = RouterTap(self.model)
            except RoutingError as exc:
                raise ConfigError(f"config field 'rollout.return_routed_experts': {exc}") from None
        torch.manual_seed(seed)

    def reseed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def _generate(self, prompts: list[PromptInput], n: int, params: SamplingParams) -> list[list[Completion]]:
        import torch

        tok = self.tokenizer
        prompt_ids = [p if isinstance(p, list) else tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        batch = tok.pad({"input_ids": prompt_ids}, return_tensors="pt")
        input_ids = batch["input_ids"].repeat_interleave(n, 0).to(self.device)
        attention = batch["attention_mask"].repeat_interleave(n, 0).to(self.device)
        greedy = params.temperature <= 0
        sampling = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p}
        if params.ignore_eos:  # no stop token: every sequence runs to max_new_tokens
            sampling["eos_token_id"] = None
        recorder = _logprob_recorder(1.0 if greedy else params.temperature)
        with torch.inference_mode(), (self.tap.recording() if self.tap else contextlib.nullcontext()) as recorded:
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention, do_sample=not greedy,
                max_new_tokens=params.max_new_tokens, return_dict_in_generate=True,
                logits_processor=[recorder], pad_token_id=tok.pad_token_id, **sampling)
            new = out.sequences[:, input_ids.shape[1]:]
            logprobs = recorder.finish(new)
        new, logprobs = new.cpu().tolist(), logprobs.cpu().numpy().astype(np.float32)
        eos = None if params.ignore_eos else tok.eos_token_id
        lengths = [resp.index(eos) + 1 if eos in resp else len(resp) for resp in new]
        routes = (generated_routes(recorded, self.tap.layers, self.tap.topk, attention, lengths)
                  if self.tap else [None] * len(new))
        results: list[list[Completion]] = []
        for i, ids in enumerate(prompt_ids):
            samples = []
            for j in range(i * n, (i + 1) * n):
                length = lengths[j]
                resp = new[j][:length]
                samples.append(Completion(text=tok.decode(resp, skip_special_tokens=True),
                                          prompt_ids=list(ids), response_ids=resp,
                                          response_logprobs=logprobs[j, :length].copy(),
                                          finish_reason="stop" if eos in resp else "length", policy_version=0,
                                          routed_experts=routes[j]))
            results.append(samples)
        return results

    def _load_weights(self, uri: str, base_uri: str | None = None) -> None:
        """Full weights: copied into the running model (no second model in memory). A LoRA
        version (``base_uri``): the base copied in once (when it is not the one held), then the
        version's adapter onto it: injected with PEFT the first time, its tensors copied into
        the adapter in place after that (the base is never read again)."""
        if base_uri is None:
            self._unwrap()
            self._copy_full(uri)
            return
        if self._base != base_uri:
            self._unwrap()
            self._copy_full(base_uri)
            self._base = base_uri
        self._load_adapter(weights_path(uri))

    def _unwrap(self) -> None:
        """The plain model again (the adapter's layers taken out, the base's weights as they are)."""
        if self._adapter_shape is not None:
            self.model = self.model.unload()
            self._adapter_shape = None
        self._base = None

    def _load_adapter(self, path) -> None:
        import json

        import torch
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load_file

        from streamrl.errors import need

        need("peft", "gpu", "LoRA adapters on the transformers backend")
        if not (path / "adapter_config.json").is_file():
            raise WeightLoadError(f"{path}: no adapter_config.json (a version with base_uri is a PEFT adapter)")
        config = json.loads((path / "adapter_config.json").read_text())
        shape = tuple(json.dumps(config.get(k), sort_keys=True) for k in ("r", "lora_alpha", "target_modules",
                                                                          "use_rslora", "fan_in_fan_out"))
        if self._adapter_shape != shape:  # the first adapter, or one of another rank / targets
            if self._adapter_shape is not None:
                self.model = self.model.unload()
            self.model = PeftModel.from_pretrained(self.model, str(path), is_trainable=False).eval()
            self._adapter_shape = shape
            return
        tensors = load_file(str(path / "adapter_model.safetensors"), device=str(self.device))
        expected = sum(1 for n, _ in self.model.named_parameters() if ".lora_" in n)
        with torch.no_grad():
            result = set_peft_model_state_dict(self.model, tensors)
        if result.unexpected_keys or len(tensors) != expected:
            raise WeightLoadError(f"adapter {str(path)!r} does not fit the model: {len(tensors)} tensors for "
                                  f"{expected} adapter parameters, unexpected {sorted(result.unexpected_keys)[:5]}")

    def _copy_full(self, uri: str) -> None:
        """Copy a version's full tensors into the running model."""
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
