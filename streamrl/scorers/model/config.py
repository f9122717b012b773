"""The ``type: model`` scorer's config (a ``reward.scorers`` entry's ``model:`` section), checked
at start naming the field."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from streamrl.errors import ConfigError

BACKENDS = ("transformers", "http", "vllm", "sglang")
ACTIVATION_FIELDS = ("auto", "activation", "use_activation")


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
    server: str = ""  # the name of a reward.servers entry to score on (instead of urls)
    model: str = ""  # model name sent to the server
    # vllm: the name of the "no activation" request field; auto: by the server's /version
    activation_field: str = "auto"
    api_key_env: str = ""  # NAME of the environment variable holding the servers' key; "" = no key
    timeout_s: float = 60.0  # per request
    max_retries: int = 3  # per batch, on another server where there is one
    backoff_s: float = 0.5  # first retry's wait; doubles each time, with jitter
    backoff_max_s: float = 10.0  # the longest wait between retries
    health_path: str = "/health"  # GET on each server root to check its health
    health_interval_s: float = 5.0  # how often each server's health_path is checked
    eject_after: int = 3  # consecutive failures that take a server out of rotation

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
