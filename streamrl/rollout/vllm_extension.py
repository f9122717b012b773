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

Only a path string arrives over HTTP (vLLM passes string arguments only): nothing is unpickled.
"""

from __future__ import annotations

from pathlib import Path


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

        self.model_runner.model.load_weights(weights=counted())  # type: ignore[attr-defined]
        return count
