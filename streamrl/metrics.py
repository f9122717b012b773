"""Every Prometheus metric streamrl exports, declared once, here.

Names follow ``streamrl_<stage>_<what>_<unit>``: the unit in base units and plural (``seconds``,
``bytes``, ``records``, ``versions``), counters end in ``_total``, points in time in
``_timestamp_seconds``; 0/1 states and ratios carry no unit. Bus-level metrics (every stage) are
``streamrl_bus_*`` and ``streamrl_consumer_*`` with a ``stage`` label. Labels are bounded (stage,
topic, partition, group, scorer, router, url, reason, client): never a trajectory or group id.
Each long-running process serves the default registry on its own port (``serve``), so processes
sharing a host do not collide.

The alert and recording rules (``configs/prometheus``) and the Grafana dashboard
(``configs/grafana``) read these names; ``tests/deploy/test_dashboard.py`` fails when they name a
metric that is not declared here.
"""

from __future__ import annotations

import platform
from importlib import metadata as _metadata

from prometheus_client import Counter, Gauge, Histogram, Info, Summary, start_http_server

from streamrl.net import free_port

# -- bus: every consuming / producing stage -----------------------------------------------------
BUS_CONSUMED = Counter("streamrl_bus_consumed_records_total", "Records taken from a topic",
                       ["stage", "topic"])
BUS_PRODUCED = Counter("streamrl_bus_produced_records_total", "Records acknowledged by the broker",
                       ["stage", "topic"])
BUS_PRODUCED_BYTES = Counter("streamrl_bus_produced_bytes_total", "Bytes of records acknowledged",
                             ["stage", "topic"])
BUS_DEADLETTERS = Counter("streamrl_bus_deadletter_records_total",
                          "Records sent to the dead-letter topic", ["stage", "reason"])
BUS_IN_FLIGHT = Gauge("streamrl_bus_in_flight_records", "Records taken but not yet finished",
                      ["stage"])
BUS_COMMITS = Counter("streamrl_bus_commits_total", "Offset commits", ["stage"])
BUS_COMMIT_ERRORS = Counter("streamrl_bus_commit_errors_total", "Failed offset commits", ["stage"])
BUS_COMMITTED_RECORDS = Counter("streamrl_bus_committed_records_total",
                                "Records this group member's commits moved its group past: its share of "
                                "the group's work (an idle member stays at 0)", ["stage", "topic"])
BUS_HANDLER_SECONDS = Histogram("streamrl_bus_handle_seconds", "Time from taking a record to its "
                                "outputs being acknowledged", ["stage"],
                                buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
CONSUMER_LAG = Gauge("streamrl_consumer_lag_records",
                     "Log end offset minus committed offset, per partition",
                     ["stage", "group", "topic", "partition"])
CONSUMER_LAST_PROGRESS = Gauge("streamrl_consumer_last_progress_timestamp_seconds",
                               "Unix time of the last finished record", ["stage", "group"])
CONSUMER_OLDEST_AGE = Gauge("streamrl_consumer_oldest_unconsumed_age_seconds",
                            "Age (now minus the record's Kafka timestamp) of the oldest record this "
                            "member has taken but not finished, per partition; 0 when none is "
                            "waiting. Grows while a stage holds records it cannot finish.",
                            ["stage", "group", "topic", "partition"])
BUS_BROKER_REACHABLE = Gauge("streamrl_bus_broker_reachable",
                             "1 if the last request of this client to the broker succeeded, 0 if it "
                             "failed to connect or timed out", ["stage", "client"])

BUS_SEND_RETRIES = Counter("streamrl_bus_send_retries_total",
                           "Outputs sent again after a transient Kafka error (leader change, timeout, restart)",
                           ["stage"])

# -- build: one series per process, value 1; join on it to see which version runs where ------------
BUILD_INFO = Info("streamrl_build", "streamrl build: version, Python, Kafka client")
try:
    _version = _metadata.version("streamrl")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    _version = "unknown"
BUILD_INFO.info({"version": _version, "python": platform.python_version(),
                 "confluent_kafka": _metadata.version("confluent-kafka")})


def serve(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve the registry on ``port`` (0: a free one) and return the port."""
    if port == 0:
        port = free_port(host)
    start_http_server(port, addr=host)
    return port


# -- judge / model scorers ----------------------------------------------------------------------
# ``router`` is the scorer's name in the config (e.g. "judge"); ``url`` is one of its configured
# server URLs (never anything read from a record), so both stay bounded.
ROUTER_REQUESTS = Counter("streamrl_reward_router_requests_total",
                          "Requests sent to a judge / reward server", ["router", "url"])
ROUTER_ERRORS = Counter("streamrl_reward_router_request_errors_total",
                        "Failed requests to a judge / reward server (reason: timeout, connect, "
                        "http_5xx, http_429, http_4xx, bad_response, health, stream_timeout)", ["router", "url", "reason"])
ROUTER_RETRIES = Counter("streamrl_reward_router_retries_total",
                         "Requests retried after failing on this server", ["router", "url"])
ROUTER_REQUEST_SECONDS = Histogram("streamrl_reward_router_request_seconds",
                                   "Latency of one request to a judge / reward server",
                                   ["router", "url"],
                                   buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
ROUTER_OUTSTANDING = Gauge("streamrl_reward_router_outstanding_requests",
                           "Requests sent and not yet answered", ["router", "url"])
ROUTER_EJECTED = Gauge("streamrl_reward_router_ejected_servers",
                       "Servers taken out of rotation (consecutive failures) until a health check "
                       "passes", ["router"])
RATELIMIT_WAIT = Counter("streamrl_reward_ratelimit_wait_seconds_total",
                         "Seconds spent waiting for this member's share of the group's RPM / TPM "
                         "budget (kind: requests, tokens)", ["router", "kind"])
MODEL_BATCH_SIZE = Histogram("streamrl_reward_model_batch_records", "Records per reward-model batch",
                             ["scorer"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
MODEL_BATCH_SECONDS = Histogram("streamrl_reward_model_batch_seconds",
                                "Time to score one reward-model batch (tokenise + forward)",
                                ["scorer"],
                                buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))

# -- learner --------------------------------------------------------------------------------------
LEARNER_VERSION = Gauge("streamrl_learner_policy_version", "The last policy version the learner finished")
LEARNER_DEDUP_IDS = Gauge("streamrl_learner_dedup_ids",
                          "Finished record ids the learner remembers to skip copies of (its de-duplication "
                          "window: learner.dedup_versions / dedup_seconds; flat over a long run)")
LEARNER_MAX_STALENESS = Gauge("streamrl_learner_max_staleness_versions",
                              "The configured staleness bound (learner.max_staleness): alerts compare to it")
LEARNER_RECORDS = Counter("streamrl_learner_records_total",
                          "Records taken from rewarded, by outcome (trained, dropped, duplicate)",
                          ["outcome"])
LEARNER_DROPPED = Counter("streamrl_learner_dropped_records_total",
                          "Records sent to dead letters by the learner, by reason (stale, ...)",
                          ["reason"])
LEARNER_GROUPS = Counter("streamrl_learner_groups_total",
                         "Groups by outcome: trained, partial (trained), or dropped as stale / group_timeout", ["outcome"])
LEARNER_STEP_SECONDS = Histogram("streamrl_learner_step_seconds", "Time of one mini-batch update",
                                 buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
LEARNER_TOKENS = Counter("streamrl_learner_trained_tokens_total", "Response tokens trained on")
LEARNER_LOSS = Gauge("streamrl_learner_loss", "Loss parts of the last update", ["part"])
LEARNER_REWARD = Gauge("streamrl_learner_reward", "Reward of the last mini-batch", ["stat"])
LEARNER_KL = Gauge("streamrl_learner_kl", "KL of the last update: to the reference (ref) and the "
                   "approximate KL to the old policy (ppo)", ["to"])
LEARNER_ENTROPY = Gauge("streamrl_learner_entropy", "Token entropy of the last update")
LEARNER_GRAD_NORM = Gauge("streamrl_learner_grad_norm", "Gradient norm before clipping")
LEARNER_CLIP_FRACTION = Gauge("streamrl_learner_clip_fraction", "Tokens whose ratio was clipped")
LEARNER_STALENESS = Histogram("streamrl_learner_staleness_versions",
                              "Learner version minus policy_version of trained records",
                              buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
LEARNER_SPAN = Histogram("streamrl_learner_span_versions",
                         "Policy versions a trained record's tokens span, oldest to newest (partial rollouts; 1: one)",
                         buckets=(1, 2, 3, 4, 6, 8, 16))
LEARNER_WORST_STALENESS = Gauge("streamrl_learner_worst_staleness_versions",
                                "Learner version minus the oldest token's version in the last mini-batch")
LEARNER_STALENESS_SECONDS = Histogram(
    "streamrl_learner_staleness_seconds",
    "Age of trained records by part: generation, reward (created -> scored), learner (scored -> taken)",
    ["part"], buckets=(.01, .05, .1, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
LEARNER_STARVED_SECONDS = Counter("streamrl_learner_starved_seconds_total",
                                  "Time the learner waited for a full mini-batch")
LEARNER_CHECKPOINT_SECONDS = Histogram("streamrl_learner_checkpoint_seconds", "Time to write a checkpoint",
                                       buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
LEARNER_WEIGHTS_PUBLISH_SECONDS = Histogram(
    "streamrl_learner_weights_publish_seconds",
    "Time to gather the full weights (from the FSDP shards) and write them for rollout workers",
    buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
# learner.weights_delta (streamrl.weights.delta): what each version published, and what readers rebuild
LEARNER_WEIGHTS_BYTES = Counter("streamrl_learner_weights_bytes_total",
                                "Bytes of weight files published, by kind (full: a whole version; delta: "
                                "the XOR against the previous version, compressed)", ["kind"])
LEARNER_WEIGHTS_DELTA_RATIO = Gauge("streamrl_learner_weights_delta_ratio",
                                    "The last delta's bytes as a share of its full version's")
LEARNER_WEIGHTS_ENCODE_SECONDS = Histogram(
    "streamrl_learner_weights_encode_seconds",
    "Time to checksum a written version and encode it as a delta (or mark it full)",
    buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
WEIGHTS_RECONSTRUCT_SECONDS = Histogram(
    "streamrl_weights_reconstruct_seconds",
    "Time for a reader (rollout worker, eval, teacher, export) to rebuild a version published as a delta",
    buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
WEIGHTS_RECONSTRUCT_FAILURES = Counter(
    "streamrl_weights_reconstruct_failures_total",
    "Versions a reader could not rebuild from their delta (a checksum differed, a file was missing): the load "
    "failed and the next one starts from the chain's full version")


# -- reward --------------------------------------------------------------------------------------
# ``scorer`` is an entry name of the config's scorer table (bounded); ``reason`` a failure reason
# (a Failure's reason, "timeout", "scorer_error", "non_finite_reward", ...).
REWARD_SCORED = Counter("streamrl_reward_scored_records_total",
                        "Records scored and handed on to the rewarded topic (status: ok, or the "
                        "fallback the config allowed)", ["scorer", "status"])
REWARD_FAILED = Counter("streamrl_reward_failed_records_total",
                        "Records the scorer failed on for good (dead-lettered)", ["scorer", "reason"])
REWARD_ATTEMPT_ERRORS = Counter("streamrl_reward_attempt_errors_total",
                                "Scoring attempts that raised, retried or not", ["scorer", "reason"])
REWARD_WORKER_DEATHS = Counter("streamrl_reward_worker_deaths_total",
                               "Scorer worker processes (executor: process) that died under a record; "
                               "the pool replaces the worker and the record is tried on a fresh one",
                               ["scorer"])
REWARD_UNAVAILABLE = Counter("streamrl_reward_unavailable_total",
                             "Scoring attempts that found the scorer's backend down (the record "
                             "is held and tried again, never scored 0)", ["scorer"])
REWARD_HELD = Gauge("streamrl_reward_held_records",
                    "Records waiting for a scorer whose backend is down", ["scorer"])
REWARD_SCORE_SECONDS = Histogram("streamrl_reward_score_seconds",
                                 "Time to score one record (one attempt that returned)", ["scorer"],
                                 buckets=(.0005, .001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5,
                                          5, 10, 30, 60, 120))
REWARD_VALUE = Histogram("streamrl_reward_value", "Rewards published, before any group hook",
                         ["scorer"], buckets=(-1, -.5, 0, .1, .25, .5, .75, .9, 1, 2, 5))
# verl logs a scorer's extra fields (its reward_extra_info: acc, pred, overlong, ...) per data
# source; these are their numeric values (bools as 0/1), _sum / _count the mean. ``field`` is a
# key the scorer returns, ``data_source`` a routed data source: the stage keeps at most
# REWARD_INFO_MAX_SERIES pairs per process, so neither can grow without bound.
REWARD_INFO = Summary("streamrl_reward_info", "Numeric fields a scorer returns beside its score "
                      "(verl's reward_extra_info, e.g. acc), per data source", ["data_source", "field"])
REWARD_INFO_MAX_SERIES = 200
REWARD_GROUPS = Counter("streamrl_reward_groups_total",
                        "Groups through the group hook (status: applied, incomplete, late, "
                        "hook_error)", ["status"])
REWARD_GROUPS_PENDING = Gauge("streamrl_reward_groups_pending",
                              "Groups waiting for their remaining members")
REWARD_PARTITION_SHARE = Gauge("streamrl_reward_partition_share",
                               "This member's share of the source topic's partitions (its share "
                               "of group-wide rate limits)", ["group"])

# -- rollout -------------------------------------------------------------------------------------
# ``backend``: transformers | vllm | openai.
ROLLOUT_PROMPTS = Counter("streamrl_rollout_prompts_total", "Prompts taken from the feed", ["backend"])
ROLLOUT_TRAJECTORIES = Counter("streamrl_rollout_trajectories_total",
                               "Trajectories generated and handed to the producer", ["backend"])
ROLLOUT_TOKENS = Counter("streamrl_rollout_generated_tokens_total",
                         "Tokens sampled by the policy (rate() of it: tokens/s)", ["backend"])
GATEWAY_CALLS = Counter("streamrl_gateway_calls_total",
                        "Chat completion calls the gateway answered, by outcome (ok, or the HTTP status)", ["outcome"])
GATEWAY_CALL_SECONDS = Histogram("streamrl_gateway_call_seconds", "Time to answer one chat completion call",
                                 buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
GATEWAY_EPISODES = Counter("streamrl_gateway_episodes_total",
                           "Episodes the gateway closed: published (ended by the agent) or abandoned (timed out)",
                           ["outcome"])
GATEWAY_OPEN = Gauge("streamrl_gateway_open_episodes", "Episodes open on the gateway")
ROLLOUT_GENERATION_SECONDS = Histogram("streamrl_rollout_generation_seconds",
                                       "Time to generate one prompt's whole group, all turns",
                                       ["backend"], buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30,
                                                             60, 120, 300, 600))
ROLLOUT_BACKEND_UNAVAILABLE = Counter("streamrl_rollout_backend_unavailable_total",
                                      "Generations that found the backend down (the prompt is "
                                      "held and tried again)", ["backend"])
ROLLOUT_POLICY_VERSION = Gauge("streamrl_rollout_policy_version",
                               "Policy version of the weights this worker samples with")
ROLLOUT_GATE_HELD = Gauge("streamrl_rollout_gate_held",
                          "1 while the staleness gate holds this worker back")
ROLLOUT_GATE_PAUSED = Counter("streamrl_rollout_gate_paused_seconds_total",
                              "Time this worker spent held back by the staleness gate")
ROLLOUT_WEIGHT_LOAD_SECONDS = Histogram("streamrl_rollout_weight_load_seconds",
                                        "Time to load one policy version",
                                        buckets=(.01, .05, .1, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
ROLLOUT_WEIGHT_LOAD_ERRORS = Counter("streamrl_rollout_weight_load_errors_total",
                                     "Policy versions that could not be loaded (the old weights stay)")
ROLLOUT_WEIGHTS_REFUSED = Gauge("streamrl_rollout_weights_refused_version",
                                "The newest policy version this worker refused or failed to load, by why "
                                "(not_allowed: outside rollout.weights_prefixes; no_uri; load_failed); -1: "
                                "none refused since the last load", ["reason"])

# -- run ------------------------------------------------------------------------------------------
STAGE_WAITING = Gauge("streamrl_stage_waiting",
                      "1 while the stage waits, by what on (streamrl run names it on its status line "
                      "when nothing moves)", ["stage", "on"])
_waiting: dict[str, str | None] = {}


def waiting(stage: str, on: str | None) -> None:
    """Say what ``stage`` waits on now (a short, stable word: ``staleness_gate``, ``records``,
    ``incomplete_groups``), or None: it works."""
    before = _waiting.get(stage)
    if before == on:
        return
    if before is not None:
        STAGE_WAITING.labels(stage, before).set(0)
    if on is not None:
        STAGE_WAITING.labels(stage, on).set(1)
    _waiting[stage] = on


# -- the eval stage (streamrl.evaluation) ----------------------------------------------------------
EVAL_VERSIONS = Counter("streamrl_eval_versions_total",
                        "Asked policy versions by outcome: evaluated, skipped_stale (eval.skip_stale), "
                        "no_weights (pruned or unreadable), refused (weights_uri outside the allowed paths)",
                        ["outcome"])
EVAL_VERSION = Gauge("streamrl_eval_policy_version", "The last policy version the eval stage evaluated")
EVAL_SCORE = Gauge("streamrl_eval_score", "The last evaluation's core figure (verl's val-core <core>/mean@n)",
                   ["data_source"])
EVAL_SECONDS = Histogram("streamrl_eval_seconds", "Time to evaluate one version (load, generate, score, publish)",
                         buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600))

RUN_RESTARTS = Counter("streamrl_run_stage_restarts_total",
                       "Stages restarted by streamrl run's supervisor after an unexpected exit", ["stage"])

# -- replay --------------------------------------------------------------------------------------
# ``outcome``: read (messages in the offset window), skipped (outside the time / version bounds),
# duplicate, decode_failed, scored, score_failed, published.
REPLAY_RECORDS = Counter("streamrl_replay_records_total",
                         "Messages and records through a replay, by outcome", ["outcome"])

# -- archive ----------------------------------------------------------------------------------
ARCHIVE_RECORDS = Counter("streamrl_archive_records_total", "Records written to archive files (durable)",
                          ["topic"])
ARCHIVE_FILES = Counter("streamrl_archive_files_total", "Archive files written", ["topic"])
ARCHIVE_BYTES = Counter("streamrl_archive_bytes_total", "Bytes of archive files written", ["topic"])
ARCHIVE_WRITE_SECONDS = Histogram("streamrl_archive_write_seconds", "Time to build and write one archive file",
                                  ["topic"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
ARCHIVE_BUFFERED = Gauge("streamrl_archive_buffered_records", "Records read but not yet in a durable file")

# -- rollout server fleet (streamrl.rollout.fleet) ---------------------------------------------
ROLLOUT_SERVER_VERSION = Gauge("streamrl_rollout_server_policy_version",
                               "Policy version each rollout server has loaded", ["server"])
ROLLOUT_SERVER_UPDATE_SECONDS = Histogram("streamrl_rollout_server_update_seconds",
                                          "One server's weight load (after draining or aborting)",
                                          buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
ROLLOUT_SERVER_UPDATE_FAILURES = Counter("streamrl_rollout_server_update_failures_total",
                                         "Failed weight loads on a rollout server (it is out until one succeeds)",
                                         ["server"])
ROLLOUT_SERVERS_OUT = Gauge("streamrl_rollout_servers_out",
                            "Rollout servers out of rotation (update failed or ejected by health checks)")
ROLLOUT_SERVERS = Gauge("streamrl_rollout_servers",
                        "Rollout servers by state: on the learner's latest version, loading one, or out", ["state"])
ROLLOUT_SERVER_HANGS = Counter("streamrl_rollout_server_hangs_total",
                               "Times a rollout server streamed nothing for rollout.openai.stream_timeout_s with "
                               "requests in flight (ejected; its requests continued on another server)", ["server"])
ROLLOUT_REQUESTS_FAILED_OVER = Counter("streamrl_rollout_requests_failed_over_total",
                                       "Requests cut from a rollout server that stopped streaming and continued on "
                                       "another from the tokens they had streamed")
ROLLOUT_REQUESTS_CONTINUED = Counter("streamrl_rollout_requests_continued_total",
                                     "Responses interrupted by a weight update and continued from their "
                                     "partial response on the new weights (rollout.on_update: partial)")
ROLLOUT_SPAN_DROPPED = Counter("streamrl_rollout_span_dropped_trajectories_total",
                               "Trajectories finished but dead-lettered stale: their tokens span more "
                               "than rollout.max_span versions")
ROLLOUT_REQUESTS_ABORTED = Counter("streamrl_rollout_requests_aborted_total",
                                   "Requests aborted for a weight update and resubmitted (rollout.on_update abort)")


# -- teacher (on-policy distillation) -----------------------------------------------------------
# Its consumer lag is the common streamrl_consumer_lag_records{stage="teacher"}.
TEACHER_ANNOTATED = Counter("streamrl_teacher_annotated_records_total",
                            "Records the teacher annotated and handed on to the distilled topic", ["backend", "teacher"])
TEACHER_TOKENS = Counter("streamrl_teacher_annotated_tokens_total", "Response tokens the teacher annotated",
                         ["backend", "teacher"])
TEACHER_FAILED = Counter("streamrl_teacher_failed_records_total",
                         "Records the teacher failed on for good (dead-lettered)", ["reason", "teacher"])
# several teachers (distillation.teacher_models): records of another teacher's data source passed
# over, and records no teacher serves (teacher.unserved: train, handed on unannotated, or deadletter)
TEACHER_PASSED = Counter("streamrl_teacher_passed_records_total",
                         "Records of another teacher's data source a teacher group passed over", ["teacher"])
TEACHER_UNSERVED = Counter("streamrl_teacher_unserved_records_total",
                           "Records whose data source no teacher serves, by what became of them (train, deadletter)",
                           ["outcome"])
TEACHER_BATCH_SECONDS = Histogram("streamrl_teacher_batch_seconds", "Time of one teacher forward pass (a batch)",
                                  ["backend"], buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
TEACHER_BATCH_SIZE = Histogram("streamrl_teacher_batch_records", "Records per teacher forward pass", ["backend"],
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128))

# -- sandbox (streamrl sandbox: policy-written code, isolated) and the code scorer that calls it ---------
SANDBOX_REQUESTS = Counter("streamrl_sandbox_requests_total", "run_code requests taken (valid ones)")
SANDBOX_REJECTED = Counter("streamrl_sandbox_rejected_requests_total", "run_code requests refused (reason: bad_request)",
                           ["reason"])
SANDBOX_EXECUTIONS = Counter("streamrl_sandbox_executions_total",
                             "Programs run, by how they ended (outcome: success, failed, wall_limit, cpu_limit, "
                             "output_limit, sandbox_error: the service's own failure)", ["language", "outcome"])
SANDBOX_SECONDS = Histogram("streamrl_sandbox_execution_seconds", "Time of one run_code request, queue wait included",
                            ["language"], buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
SANDBOX_WAITING = Gauge("streamrl_sandbox_waiting_requests",
                        "Requests waiting for an execution slot: the queue KEDA scales the sandbox group on")
SANDBOX_IN_FLIGHT = Gauge("streamrl_sandbox_in_flight_requests", "Requests taken and not yet answered")
SANDBOX_SLOTS = Gauge("streamrl_sandbox_slots", "Programs this member runs at once")
SANDBOX_ISOLATION = Info("streamrl_sandbox_isolation", "The isolation this member measured at start "
                         "(level namespaces: every layer; none: the named opt-out)")
CODE_CASES = Counter("streamrl_reward_code_cases_total", "Test cases the code scorer ran, by result "
                     "(pass, wrong_answer, runtime_error, timeout, compile_error)", ["backend", "result"])
CODE_SANDBOX_ERRORS = Counter("streamrl_reward_code_sandbox_errors_total",
                              "Code-scorer calls the sandbox could not serve (the record is held and retried, "
                              "never scored 0; reason: connect, timeout, http, sandbox_error)", ["reason"])
