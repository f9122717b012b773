"""streamrl's vLLM worker extension: lets ``vllm serve`` load a policy version from disk when
the rollout fleet asks (``streamrl.rollout.fleet``).

Start the server with it (``rollout.servers_launch`` does)::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --worker-extension-cls streamrl.rollout.vllm_extension.WeightFollowerExtension

vLLM mixes this class into each of its GPU workers; its dev-mode endpoint ``POST
/collective_rpc {"method": "streamrl_load_weights", "args": [PATH]}`` then runs the method in
every worker (every tensor-parallel rank), and each reads the version's ``*.safetensors`` from
``PATH`` itself and hands them to the model's own ``load_weights`` (which shards them), so no
tensor crosses the network and the KV cache and CUDA graphs are kept. The fleet resets the
prefix cache afterwards (``POST /reset_prefix_cache``). The module imports nothing of streamrl
(only ``safetensors``, which vLLM ships), so it also works as a single file on the server's
``PYTHONPATH`` without streamrl installed (the compose file mounts it that way).

A quantised engine (``rollout.quantization``, e.g. ``vllm serve --quantization fp8``) holds
each layer's weights in its kernel's form (fp8 values and scales), which the model's
``load_weights`` cannot take full-precision tensors into: there the version is loaded with the
model runner's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (vLLM's
layerwise reloading), which restores each layer's checkpoint layout, loads the published
bf16/fp32 tensors and quantises the layer again, as at start. A vLLM without it refuses the
load (an error the fleet reports and retries), never serving stale or half-cast weights.

Only a path string arrives over HTTP (vLLM passes string arguments only): nothing is unpickled.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterable


class WeightFollowerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``self.model_runner``)."""

    def streamrl_load_weights(self, path: str) -> int:
        """Load every tensor under ``path`` into the running model; returns how many."""
        from safetensors import safe_open

        directory = Path(str(path).removeprefix("file://"))
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory}: no *.safetensors files")
        count = 0

        def counted():  # one tensor at a time: never the whole state dict in host memory
            nonlocal count
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        count += 1
                        yield name, f.get_tensor(name)

        load_into(self.model_runner, counted())  # type: ignore[attr-defined]
        return count


def load_into(model_runner: Any, weights: Iterable[Any]) -> None:
    """``weights`` (checkpoint names, full precision) into the running model: the model's own
    ``load_weights``, or, for a quantised engine, the runner's layerwise ``reload_weights``
    (see the module's doc)."""
    quantization = getattr(getattr(model_runner, "model_config", None), "quantization", None)
    if not quantization:
        model_runner.model.load_weights(weights=weights)
        return
    reload = getattr(model_runner, "reload_weights", None)
    if reload is None or "weights_iterator" not in inspect.signature(reload).parameters:
        raise RuntimeError(f"this vLLM cannot load full-precision weights into a {quantization}-quantised engine: "
                           "rollout.quantization needs a vLLM whose model runner has reload_weights(weights_iterator, "
                           "is_checkpoint_format) (layerwise reloading)")
    reload(weights_iterator=weights, is_checkpoint_format=True)
