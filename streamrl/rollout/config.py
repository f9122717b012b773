"""The ``rollout`` section of the pipeline config (``PipelineConfig.rollout``). Plain dataclasses:
OmegaConf checks YAML and ``key.path=value`` overrides against
them at start, naming a bad field; ``validate()`` adds the cross-field rules a type cannot say."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamrl.errors import ConfigError

BACKENDS = ("transformers", "vllm", "openai")


@dataclass
class InteractionConfig:
    """One interaction for every sample (streamrl's older form; verl's per-sample form is
    ``rollout.multi_turn``). ``name`` empty: none. Otherwise a registered name (``gsm8k``) or
    the path of a class with verl's Interaction API (``my_pkg.my_module:MyInteraction``);
    ``kwargs`` go to its constructor as verl's ``config``. Its turn limits are its own; tools
    and the other limits come from ``rollout.multi_turn``."""

    name: str = ""  # a registered interaction (gsm8k) or a class path; empty: none
    max_assistant_turns: int = 3  # model turns per episode
    max_user_turns: int = 2  # interaction feedback turns per episode
    kwargs: dict[str, Any] = field(default_factory=dict)  # to the interaction's constructor (verl's config)


@dataclass
class MultiTurnConfig:
    """verl's ``rollout.multi_turn`` (same field names): interactions picked per sample from an
    interaction config, tools from a tool config, and the limits of an episode. Either path set
    turns multi-turn on; both empty (and ``rollout.interaction.name`` empty): single turn.

    - ``interaction_config_path``: verl's interaction config (``interaction: [{name, class_name,
      config}]``); each sample names its interaction in ``extra_info.interaction_kwargs.name``.
    - ``tool_config_path``: verl's tool config (``tools: [{class_name, config, tool_schema}]``);
      every tool is offered to every sample, ``extra_info.tools_kwargs`` configures it per sample.
    A relative path that is not a file names a packaged one (``interaction_config/gsm8k.yaml``)."""

    interaction_config_path: str = ""  # verl's interaction config file (see above); empty: none
    tool_config_path: str = ""  # verl's tool config file (see above); empty: no tools
    max_assistant_turns: int = 3  # model turns per episode (verl: null = unbounded; here >= 1)
    # Non-model turns per episode: interaction feedback and rounds of tool responses, counted
    # together as verl's agent loop counts them.
    max_user_turns: int = 2
    max_parallel_calls: int = 1  # tool calls executed per model turn; further ones are ignored
    max_tool_response_length: int = 256  # characters of a tool's answer shown to the model
    tool_response_truncate_side: str = "middle"  # left (keep the start) | right (keep the end) | middle
    tool_timeout_s: float = 30.0  # per tool call (create + execute); past it the model reads an error
    format: str = "hermes"  # how tool calls are written: <tool_call>{"name", "arguments"}</tool_call>

    @property
    def enabled(self) -> bool:
        return bool(self.interaction_config_path or self.tool_config_path)


@dataclass
class AgentConfig:
    """verl's ``rollout.agent`` (same field names): a user's agent-loop classes run in the rollout
    workers (``streamrl.rollout.agent_loops``). A prompt's ``agent_name`` (``extra_info``) picks its
    loop, ``default_agent_loop`` the others'. verl's built-in names, ``single_turn_agent`` and
    ``tool_agent``, are the workers' own turn loop (one turn, or ``multi_turn``'s tools and
    interactions) unless the config file names classes for them."""

    default_agent_loop: str = "single_turn_agent"  # the loop of a prompt without an agent_name
    # verl's agent-loop config: a YAML list of {name, _target_: module.Class, ...constructor keywords}
    agent_loop_config_path: str = ""
    prompt_length: int = 0  # what a loop reads as rollout_config.prompt_length (verl: data.max_prompt_length); 0: no cap
    # what a loop reads as rollout_config.response_length, the whole response's budget (verl:
    # data.max_response_length); 0: rollout.max_new_tokens
    response_length: int = 0


@dataclass
class GatewayConfig:
    """``streamrl gateway``: an OpenAI-compatible chat endpoint for agents outside streamrl
    (``streamrl.rollout.gateway``). It samples with this rollout section's backend and
    settings; each episode's exact tokens go to ``rollouts`` when the agent ends it."""

    host: str = "127.0.0.1"  # the interface the gateway listens on
    port: int = 8400  # 0: a free port (printed at start)
    # an episode with no call for this long is abandoned: its tokens so far go to dead letters
    episode_timeout_s: float = 600.0
    # open episodes are journalled here after every call and taken up again after a restart;
    # empty: kept in memory only (a restart abandons them)
    state_dir: str = ""
    data_source: str = "agent"  # an episode's data_source when its end call names none
    max_episodes: int = 10000  # open at once; a new one past it is refused (HTTP 429)


@dataclass
class OpenAIBackendConfig:
    """Any OpenAI-compatible completions server (``vllm serve``, SGLang, hosted APIs)."""

    base_url: str = "http://127.0.0.1:8000/v1"  # the server when rollout.servers is empty
    model: str = ""  # the model name sent in each request (required with backend openai)
    api_key_env: str = "OPENAI_API_KEY"  # the *name* of the variable; unset: no Authorization header
    timeout_s: float = 300.0  # per request
    max_retries: int = 4  # per request, on connection errors / 429 / 5xx, with exponential backoff
    # Ask for token ids (vLLM's ``return_token_ids`` / ``return_tokens_as_token_ids``). A server
    # that refuses unknown fields (hosted APIs) needs False: trajectories are then text-only.
    token_ids: bool = True
    # How the servers load a new policy version (``streamrl.rollout.fleet``): sglang
    # (POST /update_weights_from_disk), vllm (POST /collective_rpc with streamrl's worker
    # extension, VLLM_SERVER_DEV_MODE=1), or none: the servers keep their weights and records
    # are stamped version 0 (a hosted model). Empty: rollout.servers_launch.backend, else none.
    update_api: str = ""
    max_requests_per_server: int = 0  # requests in flight on one server at once; 0: no limit
    update_timeout_s: float = 600.0  # one server's weight load; past it the update failed
    update_retry_s: float = 1.0  # first wait before retrying a failed update; doubles
    update_retry_max_s: float = 60.0  # the longest wait between retries of a failed update
    health_interval_s: float = 5.0  # GET /health on every server (the shared router's checks)
    eject_after: int = 3  # consecutive failed requests / health checks that take a server out
    # The weights' path the servers were started on: an announced version 0 of exactly that path
    # is served as it is; any other (streamrl run's warm start) is loaded first. Empty: loaded.
    started_on: str = ""
    # rollout.on_update partial: pause a server's requests in place for a load and resume them on
    # the new weights (SGLang /pause_generation + /continue_generation, vLLM /pause?mode=keep +
    # /resume); a server without those endpoints (404), or false here: cut them and continue
    # each with a new request from its partial response
    pause_on_update: bool = True
    # A server with requests in flight that streams nothing on any of them this long (frozen, or
    # gone with its connections left open) is ejected and each of its requests continues on
    # another server from the tokens it had streamed (any on_update: requests to servers that
    # follow the learner are streamed). Longer than a server's longest prefill and than a
    # client's wait for its first token when all its requests are queued; a paused load does not
    # count. 0: not watched, and under drain/abort one whole request per prompt (not streamed).
    stream_timeout_s: float = 30.0


@dataclass
class ServersLaunchConfig:
    """Policy servers the rollout worker starts and supervises itself (``rollout.servers_launch``),
    with the reward stage's machinery (``streamrl.servers.processes``): ``replicas`` processes of
    ``rollout.policy``, each health-checked before the first prompt, restarted with backoff when
    it dies (the fleet reloads the current version into it), stopped with the worker. Their URLs
    join ``rollout.servers``. ``backend`` empty: none launched."""

    # vllm (vllm serve + streamrl's worker extension) | sglang (sglang.launch_server) | trtllm
    # (trtllm-serve: it takes no weight updates, so only with rollout.follow_policy false)
    backend: str = ""
    replicas: int = 1  # server processes, each on its own port and devices
    gpus_per_replica: int = 1  # tensor parallel size; replica i takes devices [i*g, (i+1)*g)
    port: int = 0  # the first replica's port, replica i on port + i; 0: free ports
    host: str = "127.0.0.1"  # the interface the servers listen on
    args: list[str] = field(default_factory=list)  # appended to the command line as given
    # the engine's keyword arguments (verl's rollout.engine_kwargs.sglang / .vllm) as the
    # servers' flags: --key-with-dashes value (true: the flag alone; false, null: left out)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the server processes
    startup_timeout_s: float = 900.0  # to pass its first health check (model download and load)
    restart_backoff_s: float = 1.0  # first wait before restarting a server that died; doubles
    restart_backoff_max_s: float = 60.0  # the longest wait between restarts


UPDATE_APIS = ("none", "sglang", "vllm")
ON_UPDATE = ("drain", "abort", "partial")


@dataclass
class VLLMBackendConfig:
    """vLLM's offline engine (the ``[vllm]`` extra)."""

    gpu_memory_utilization: float = 0.85  # vLLM's share of the GPU's memory
    tensor_parallel_size: int = 1  # GPUs per engine (vLLM tensor parallelism)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # more ``vllm.LLM(...)`` arguments


@dataclass
class RolloutConfig:
    """One rollout worker: where it samples from, how, and how far ahead of the learner it may
    run."""

    backend: str = "transformers"  # transformers | vllm | openai
    policy: str = "tiny"  # "tiny" or a Hugging Face directory (transformers / vllm)
    device: str = "cpu"  # transformers: cpu | cuda | cuda:N
    dtype: str = "float32"  # transformers: the policy's dtype (float32 | bfloat16 | float16)
    seed: int = 0  # the tiny policy's init and torch's sampling RNG (transformers)
    # changes to the policy's config at load, as the learner's (verl's
    # actor_rollout_ref.model.override_config, set with learner.override_config): transformers
    # applies them to its model, vLLM's engine takes them as hf_overrides, the servers of
    # servers_launch as --hf-overrides (vLLM) / --json-model-override-args (SGLang)
    override_config: dict[str, Any] = field(default_factory=dict)
    # Quantised rollouts (verl's rollout.quantization): the engine quantises the published
    # full-precision weights as it loads each version and samples from the quantised copy; the
    # learner trains the full-precision one (the mismatch is what learner.rollout_correction is
    # for). vLLM's engine takes it as quantization=, the servers of servers_launch as
    # --quantization (vLLM: fp8, torchao, ...; SGLang: fp8). Not with transformers.
    quantization: str = ""  # the method (fp8, ...); empty: none
    # vLLM only, with quantization: a quantization config file (verl's
    # rollout.quantization_config_file; vLLM reads it as hf_overrides.quantization_config_file,
    # e.g. a torchao config's JSON for quantization torchao). Empty: none.
    quantization_config_file: str = ""
    # The consumer group on the prompts topic: workers that share it share the feed. Empty:
    # "<bus.topic_prefix>.rollout", so pipelines with different prefixes never share a group.
    group: str = ""
    group_size: int = 0  # samples per prompt; 0: the prompt record's own group_size (a pipeline sets feed.group_size to it)
    max_new_tokens: int = 256  # per assistant turn
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling; 1: off
    # Generation continues past the end-of-sequence token to max_new_tokens (verl's
    # rollout.ignore_eos; vLLM's ignore_eos, sent to OpenAI-compatible servers as ignore_eos)
    ignore_eos: bool = False
    # MoE router replay (verl's rollout.enable_rollout_routing_replay): each record carries the
    # experts the engine routed every token to (routed_experts), for learner.router_replay R3.
    # transformers: from its routers; openai: the servers' routed_experts (vLLM started with
    # --enable-return-routed-experts, SGLang with --enable-return-routed-experts), one whole
    # request per sample (vLLM streams no routing)
    return_routed_experts: bool = False
    # ReMax: one greedy response more per prompt, marked ``baseline`` (its reward is the group's
    # baseline, never trained on); the group's group_size counts it. On by itself where
    # learner.adv_estimator is remax (pipeline config)
    greedy_baseline: bool = False
    max_in_flight: int = 4  # prompts this worker works on at once; their generations share batches
    max_batch_rows: int = 0  # most sequences in one engine call; 0: transformers 64, vllm 1024
    follow_policy: bool = True  # watch the policy topic and load new versions
    # Load a version's weights only from under these prefixes (directories or URI prefixes): a
    # policy record is read from a topic, so where it points is checked. Empty: the learner's
    # learner.weights_dir (and learner.weights_uri, when set) of the same config.
    weights_prefixes: list[str] = field(default_factory=list)
    # Staleness gate. The worker holds while the trajectories in the rollouts topic (minus
    # ``gate_baseline``) reach (learner version + max_staleness + 1) * trajectories_per_version.
    # trajectories_per_version 0 disables it (the learner's batch size in trajectories).
    max_staleness: int = 1
    trajectories_per_version: int = 0  # see max_staleness (the learner's batch in trajectories)
    gate_baseline: int = 0  # records already in a reused rollouts topic before this run
    gate_poll_s: float = 0.5  # how often a held worker checks the gate again
    interaction: InteractionConfig = field(default_factory=InteractionConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    openai: OpenAIBackendConfig = field(default_factory=OpenAIBackendConfig)
    vllm: VLLMBackendConfig = field(default_factory=VLLMBackendConfig)
    # backend openai: the inference servers (roots or .../v1 URLs; a host name that resolves to
    # several addresses is one entry per address). Empty: [openai.base_url]. Requests go to the
    # eligible server with the fewest in flight (the judge's router).
    servers: list[str] = field(default_factory=list)
    # What a server does with requests in flight when it must load a new version: drain (finish
    # them on the old weights first), abort (cancel and resubmit them from their prompt), or
    # partial (stop them, load, and continue each from its partial response on the new weights:
    # verl's partial_rollout, AReaL's interruptible generation; paused and resumed where the
    # servers can, openai.pause_on_update; the transformers backend the same between decoding
    # chunks; not the vllm engine in process yet). Every token carries the version that generated it
    # (the record's token_versions when it spans several).
    on_update: str = "drain"
    # A response whose tokens span more than this many versions (oldest to newest, inclusive)
    # is finished but dead-lettered ``stale`` instead of trained. 0: no bound here (the
    # learner's max_staleness, counted from the oldest token, still drops it when too old).
    max_span: int = 0
    # on_update partial, in-process engines: new tokens per decoding chunk; a weight load waits
    # for the chunk in progress, not for the whole response
    partial_chunk_tokens: int = 32
    servers_launch: ServersLaunchConfig = field(default_factory=ServersLaunchConfig)

    def resolved_update_api(self) -> str:
        launched = self.servers_launch.backend
        return self.openai.update_api or (launched if launched in UPDATE_APIS else "none")

    def validate(self) -> "RolloutConfig":
        if self.backend not in BACKENDS:
            raise ConfigError(f"config field 'rollout.backend': {self.backend!r} is not one of {BACKENDS}")
        if self.backend == "openai" and not self.openai.model:
            raise ConfigError("config field 'rollout.openai.model': required with backend openai")
        if self.on_update not in ON_UPDATE:
            raise ConfigError(f"config field 'rollout.on_update': {self.on_update!r} is not one of {ON_UPDATE}")
        if self.openai.update_api and self.openai.update_api not in UPDATE_APIS:
            raise ConfigError(f"config field 'rollout.openai.update_api': {self.openai.update_api!r} is not "
                              f"one of {UPDATE_APIS}")
        launch = self.servers_launch
        if launch.backend and launch.backend not in ("vllm", "sglang", "trtllm"):
            raise ConfigError(f"config field 'rollout.servers_launch.backend': {launch.backend!r} is not "
                              "vllm|sglang|trtllm")
        if launch.backend == "trtllm" and (self.follow_policy or self.openai.update_api not in ("", "none")):
            raise ConfigError("config field 'rollout.servers_launch.backend': trtllm-serve takes no weight updates "
                              "(TensorRT-LLM loads new weights only in verl's own Ray engine), so its servers cannot "
                              "follow the learner: set rollout.follow_policy false for a fixed policy (an "
                              "evaluation, a teacher's or a reward model's samples), or launch vllm / sglang")
        if launch.backend and self.backend != "openai":
            raise ConfigError("config field 'rollout.servers_launch.backend': needs rollout.backend openai")
        self._validate_quantization()
        if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.servers):
            raise ConfigError("config field 'rollout.servers': every entry is an http(s):// URL")
        o = self.openai
        if o.max_requests_per_server < 0 or o.eject_after < 1 or o.update_timeout_s <= 0 or \
                not 0 < o.update_retry_s <= o.update_retry_max_s or o.health_interval_s < 0:
            raise ConfigError("config field 'rollout.openai.max_requests_per_server' / 'eject_after' / "
                              "'update_timeout_s' / 'update_retry_s': max_requests_per_server >= 0, "
                              "eject_after >= 1, update_timeout_s > 0, 0 < update_retry_s <= update_retry_max_s")
        for name in ("max_new_tokens", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field 'rollout.{name}': must be >= 1")
        if self.partial_chunk_tokens < 1:
            raise ConfigError("config field 'rollout.partial_chunk_tokens': must be >= 1")
        if self.on_update == "partial" and self.backend == "vllm":
            raise ConfigError("config field 'rollout.on_update': partial is not supported by the vllm engine "
                              "in process yet (use backend openai with vllm serve, or transformers)")
        if self.return_routed_experts and (self.backend == "vllm" or self.on_update == "partial"):
            raise ConfigError("config field 'rollout.return_routed_experts': recorded by the transformers backend and "
                              "OpenAI-compatible servers (backend openai), not with the vllm engine in process or "
                              "on_update partial (a response continued on new weights) yet")
        if not o.stream_timeout_s >= 0:  # (NaN too)
            raise ConfigError("config field 'rollout.openai.stream_timeout_s': must be >= 0 (0: not watched)")
        for name in ("group_size", "trajectories_per_version", "max_staleness", "max_batch_rows", "max_span"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config field 'rollout.{name}': must be >= 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("config field 'rollout.temperature' / 'rollout.top_p': temperature >= 0, 0 < top_p <= 1")
        if self.interaction.name and (self.interaction.max_assistant_turns < 1 or self.interaction.max_user_turns < 0):
            raise ConfigError("config field 'rollout.interaction.max_assistant_turns': >= 1 "
                              "(and max_user_turns >= 0)")
        mt = self.multi_turn
        if self.interaction.name and mt.interaction_config_path:
            raise ConfigError("config field 'rollout.interaction.name': set it or "
                              "'rollout.multi_turn.interaction_config_path', not both")
        if mt.max_assistant_turns < 1:
            raise ConfigError("config field 'rollout.multi_turn.max_assistant_turns': must be >= 1")
        for name in ("max_user_turns", "max_parallel_calls", "max_tool_response_length"):
            if getattr(mt, name) < (1 if name != "max_user_turns" else 0):
                raise ConfigError(f"config field 'rollout.multi_turn.{name}': must be >= "
                                  f"{1 if name != 'max_user_turns' else 0}")
        if mt.tool_response_truncate_side not in ("left", "right", "middle"):
            raise ConfigError("config field 'rollout.multi_turn.tool_response_truncate_side': "
                              f"{mt.tool_response_truncate_side!r} is not left|right|middle")
        if not mt.tool_timeout_s > 0:
            raise ConfigError("config field 'rollout.multi_turn.tool_timeout_s': must be > 0")
        if mt.format != "hermes":
            raise ConfigError(f"config field 'rollout.multi_turn.format': {mt.format!r} is not supported (hermes)")
        return self

    def _validate_quantization(self) -> None:
        """Quantisation needs an engine that quantises on load: vLLM's in process, or servers
        streamrl launches (an external server's flags are its own)."""
        if self.quantization_config_file and not self.quantization:
            raise ConfigError("config field 'rollout.quantization_config_file': needs rollout.quantization")
        if not self.quantization:
            return
        launched = self.servers_launch.backend
        if self.backend == "transformers":
            raise ConfigError(f"config field 'rollout.quantization': {self.quantization!r} needs an engine that "
                              "quantises as it loads (rollout.backend vllm, or servers_launch vllm / sglang); the "
                              "transformers backend samples from the weights as published")
        if self.backend == "openai" and not launched:
            raise ConfigError("config field 'rollout.quantization': the servers of rollout.servers are not launched "
                              "by streamrl (start them with their own --quantization flag), or launch them with "
                              "rollout.servers_launch")
        if launched == "trtllm":
            raise ConfigError("config field 'rollout.quantization': trtllm-serve quantises from its own --config "
                              "file (rollout.servers_launch.args), not from a flag")
        if self.quantization_config_file and launched == "sglang":
            raise ConfigError("config field 'rollout.quantization_config_file': SGLang takes no quantization "
                              "config file (vLLM's engine and servers do)")
