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
prefix cache afterwards (``POST /reset_prefix_cache``). streamrl must be installed in the
server's environment; nothing here is imported unless vLLM loads it.

Only a path string arrives over HTTP (vLLM passes string arguments only): nothing is unpickled.
"""

from __future__ import annotations

from pathlib import Path


class WeightFollowerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``self.model_runner``)."""

    def streamrl_load_weights(self, path: str) -> int:
        """Load every tensor under ``path`` into the running model; returns how many."""
        from streamrl.rollout.backends import iter_safetensors

        directory = Path(str(path).removeprefix("file://"))
        count = 0

        def counted():
            nonlocal count
            for item in iter_safetensors(directory):
                count += 1
                yield item

        self.model_runner.model.load_weights(weights=counted())  # type: ignore[attr-defined]
        return count
