"""Records that travel on the topics, and their codec.

One Kafka message carries one record: UTF-8 JSON (orjson), key = ``group_id``. The JSON Schema of
every record type lives in ``topics/<name>.json``; that file is the public contract a producer
that is not streamrl (a user's vLLM loop, a shell tool) writes against.

Token arrays (``prompt_ids``, ``response_ids``, ``response_logprobs``, ``response_mask``) are
either plain JSON lists, which any producer can write, or *packed*:
``{"dtype": "int32" | "float32" | "uint8", "b64": <base64 of the little-endian array>}``.
streamrl packs them: a 32k-token trajectory is ~400 KB packed against ~1 MB as JSON text, and
float32 log-probs survive the round trip bit for bit. A decoded record keeps them packed (the
reward stage forwards them without touching them); ``record.array(name)`` gives numpy. A
producer may set them as numpy arrays or lists; ``encode`` packs them.

Decoding parses JSON and checks the schema; it never executes anything it reads.
"""

from __future__ import annotations

import binascii
import functools
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Sequence

import numpy as np
import orjson
import pybase64
from fastjsonschema import JsonSchemaValueException

from streamrl.errors import Failure
from streamrl.topics import Topic, validator_for

TRAJECTORY_SCHEMA = "streamrl.trajectory/1"
REWARDED_SCHEMA = "streamrl.rewarded/1"
PROMPT_SCHEMA = "streamrl.prompt/1"
POLICY_SCHEMA = "streamrl.policy/1"
DEADLETTER_SCHEMA = "streamrl.deadletter/1"
EVAL_SCHEMA = "streamrl.eval/1"
DISTILLED_SCHEMA = "streamrl.distilled/1"

#: Records larger than this are refused at encode and sent to dead letters at decode. It matches
#: the topics' ``max.message.bytes`` and the clients' request limits (see ``BusConfig``).
DEFAULT_MAX_RECORD_BYTES = 16 * 1024 * 1024

_DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "uint8": np.dtype("u1"), "uint16": np.dtype("<u2")}
#: A token array in a record: packed ``{"dtype", "b64"}`` (as decoded), or numpy / a list (as built).
TokenArray = dict[str, str] | np.ndarray | list

_ARRAY_DTYPES = {
    "prompt_ids": "int32",
    "response_ids": "int32",
    "response_logprobs": "float32",
    "response_mask": "uint8",
    "teacher_logprobs": "float32",  # Distilled only
    "teacher_ids": "int32",  # Distilled only
}
#: arrays packed in the narrowest of several dtypes (MoE expert ids: uint8 up to 256 experts).
#: Kept apart from ``_ARRAY_DTYPES`` (one dtype each, the archive's typed columns): the archive
#: keeps these in the record's JSON, packed as they came.
_NARROWEST = {"routed_experts": ("uint8", "uint16")}


def _packed_dtype(name: str, value: Any) -> str:
    """The dtype ``name`` is packed in: its one dtype, or (``_NARROWEST``) the narrowest that holds it."""
    if name not in _NARROWEST:
        return _ARRAY_DTYPES[name]
    if isinstance(value, dict):
        return str(value.get("dtype", ""))
    arr = np.asarray(value)
    small, wide = _NARROWEST[name]
    return wide if arr.size and int(arr.max()) > 255 else small


class RecordError(Failure, ValueError):
    """A message that cannot become a record (``reason``: bad_json, schema, oversize, ...)."""


def pack_array(values: Any, dtype: str) -> dict[str, str]:
    """Pack a 1-D sequence as ``{"dtype", "b64"}`` (little-endian). pybase64 (SIMD): the
    standard library's base64 ran at ~600 MB/s and was most of a record's encode."""
    arr = np.ascontiguousarray(values, dtype=_DTYPES[dtype])
    return {"dtype": dtype, "b64": pybase64.b64encode_as_string(arr)}


def unpack_array(value: Any, dtype: str, name: str = "array") -> np.ndarray:
    """A plain JSON list, a packed dict or an array to a numpy array of ``dtype``."""
    want = _DTYPES[dtype]
    if isinstance(value, dict):
        try:
            return np.frombuffer(pybase64.b64decode(value["b64"], validate=True), dtype=want)
        except (binascii.Error, ValueError) as exc:
            raise RecordError("schema", f"{name}: bad base64: {exc}") from None
    try:
        return np.asarray(value, dtype=want)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordError("schema", f"{name}: {exc}") from None


def _check_packed(value: dict[str, Any], dtype: str, name: str) -> None:
    """Boundary check of a packed array without decoding it: its dtype, and that its length
    makes whole elements. The base64 alphabet is checked where the array is decoded
    (``array()``, which raises ``RecordError``): a regex over every array at every decode cost
    more than the rest of decoding together (``streamrl bench bus``), and the reward stage
    forwards arrays without decoding them."""
    if value["dtype"] != dtype:
        raise RecordError("schema", f"{name}: packed dtype {value['dtype']!r}, expected {dtype!r}")
    b64 = value["b64"]
    if len(b64) % 4:
        raise RecordError("schema", f"{name}: base64 length {len(b64)} is not a multiple of 4")
    nbytes = len(b64) // 4 * 3 - (2 if b64.endswith("==") else 1 if b64.endswith("=") else 0)
    if nbytes % _DTYPES[dtype].itemsize:
        raise RecordError("schema", f"{name}: {nbytes} bytes is not a whole number of {dtype}")


class _Record:
    """Shared codec for the record dataclasses below."""

    SCHEMA: ClassVar[str]

    @classmethod
    def size_limit(cls, record_limit: int) -> int:
        """The largest encoding allowed for this type when records may be ``record_limit``."""
        return record_limit

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if value is None and name not in _REQUIRED_NULLABLE:
                continue
            if (name in _ARRAY_DTYPES or name in _NARROWEST) and not isinstance(value, dict):
                value = pack_array(value, _packed_dtype(name, value))
            out[name] = value
        return out

    def encode(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        data = orjson.dumps(self.to_dict(), option=orjson.OPT_SERIALIZE_NUMPY)
        if len(data) > max_bytes:
            raise RecordError("oversize", f"{type(self).__name__} is {len(data)} bytes, limit {max_bytes}")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        try:
            validator_for(topic_of(cls).name)(data)
        except JsonSchemaValueException as exc:
            raise RecordError("schema", exc.message) from None
        if data.get("schema") != cls.SCHEMA:
            raise RecordError("schema", f"schema is {data.get('schema')!r}, expected {cls.SCHEMA!r}")
        for name in (*_ARRAY_DTYPES, *_NARROWEST):
            value = data.get(name)
            if value is None:
                continue
            dtype = _packed_dtype(name, value)
            if name in _NARROWEST and dtype not in _NARROWEST[name]:
                raise RecordError("schema", f"{name}: packed dtype {dtype!r}, expected one of {_NARROWEST[name]}")
            if isinstance(value, dict):
                _check_packed(value, dtype, name)
            elif value is not None:  # a text producer's plain list: pack it once, here
                data[name] = pack_array(unpack_array(value, dtype, name), dtype)
        return cls(**data)

    @classmethod
    def decode(cls, data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        """Bytes from a topic to a record, or ``RecordError`` saying why not."""
        return cls.from_dict(_parse(data, max_bytes))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A record type's field names, in order (``dataclasses.fields`` rebuilt them per encode)."""
    return tuple(f.name for f in fields(cls))


def _parse(data: bytes | None, max_bytes: int) -> dict[str, Any]:
    """A message's bytes as a JSON object, or ``RecordError``; the schema is checked later."""
    if data is None:
        raise RecordError("bad_json", "empty message (tombstone)")
    if len(data) > max_bytes:
        raise RecordError("oversize", f"{len(data)} bytes, limit {max_bytes}")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise RecordError("bad_json", str(exc)) from None
    if not isinstance(obj, dict):
        raise RecordError("schema", f"a record is a JSON object, got {type(obj).__name__}")
    return obj


_REQUIRED_NULLABLE = {"ground_truth"}


def _now() -> float:
    return time.time()


@dataclass(kw_only=True)
class Trajectory(_Record):
    """One sampled response to one prompt (``streamrl.rollouts``)."""

    SCHEMA: ClassVar[str] = TRAJECTORY_SCHEMA

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    group_id: str
    group_size: int
    policy_version: int
    data_source: str
    prompt: str | list[dict[str, Any]]
    response: str
    ground_truth: str | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_ids: TokenArray | None = None
    response_ids: TokenArray | None = None
    response_logprobs: TokenArray | None = None
    response_mask: TokenArray | None = None  # 1 where the policy produced the token (multi-turn)
    # partial rollouts: each response token's policy version as runs [[version, n_tokens], ...]
    # (``VersionRuns``); None: every token is policy_version's
    token_versions: list[list[int]] | None = None
    # MoE router replay (``streamrl.routing``): the experts the rollout engine routed each fed
    # token to, flat row-major ``routed_experts_shape`` = [rows, layers, topk], rows = prompt +
    # response - 1 (uint8, uint16 beyond 256 experts); None: not recorded
    routed_experts: TokenArray | None = None
    routed_experts_shape: list[int] | None = None
    turns: list[dict[str, Any]] | None = None
    timings: dict[str, float] | None = None  # e.g. generation_started_at, generation_s
    lineage: str | None = None  # the training line of the weights that generated it (PolicyVersion)
    # ReMax (learner.adv_estimator remax): the group's greedy response, scored like the others;
    # its reward is the group's baseline and it is never trained on. None/absent: a sample
    baseline: bool | None = None
    # the producer's own reward (an agent loop's ``reward_score``): the reward group publishes it
    # instead of scoring the record, as verl's reward loop skips a sample that has one. None: scored
    reward_score: float | None = None
    created_at: float = field(default_factory=_now)
    schema: str = TRAJECTORY_SCHEMA

    @property
    def key(self) -> bytes:
        return self.group_id.encode()

    def array(self, name: str) -> np.ndarray | None:
        """A token array as numpy (``prompt_ids``, ``response_ids``, ``response_logprobs``,
        ``response_mask``), or None when the producer sent none."""
        value = getattr(self, name)
        return None if value is None else unpack_array(value, _packed_dtype(name, value), name)

    def versions(self) -> "VersionRuns":
        """The policy versions of its response tokens (one run of ``policy_version`` without
        ``token_versions``: a record of a producer that does not stamp tokens)."""
        if self.token_versions:
            return VersionRuns.of(self.token_versions)
        ids = self.array("response_ids")
        return VersionRuns([(self.policy_version, 0 if ids is None else len(ids))])


@dataclass(frozen=True)
class VersionRuns:
    """Which policy version produced each response token, as runs ``(version, n_tokens)`` in
    token order: a response continued across weight updates (``rollout.on_update: partial``)
    has one run per version it was generated on. The record field ``token_versions`` carries
    them; ``oldest`` is the record's ``policy_version`` (what every staleness bound counts), and
    ``span`` the versions from the oldest token to the newest (1: one version)."""

    runs: list[tuple[int, int]]

    @classmethod
    def of(cls, runs: Sequence[Sequence[int]]) -> "VersionRuns":
        return cls([(int(v), int(n)) for v, n in runs])

    def extend(self, version: int, n_tokens: int) -> None:
        """``n_tokens`` more tokens of ``version`` (merged into the last run when it is the same;
        no tokens, no run: a version that produced nothing is not spanned)."""
        if not n_tokens:
            return
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1] = (version, self.runs[-1][1] + n_tokens)
        else:
            self.runs.append((version, n_tokens))

    @property
    def oldest(self) -> int:
        return min(v for v, _ in self.runs)

    @property
    def newest(self) -> int:
        return max(v for v, _ in self.runs)

    @property
    def span(self) -> int:
        return self.newest - self.oldest + 1

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.runs)

    def per_token(self) -> np.ndarray:
        """One version per token (int64)."""
        return np.repeat(np.asarray([v for v, _ in self.runs], dtype=np.int64),
                         np.asarray([n for _, n in self.runs], dtype=np.int64))

    def as_field(self) -> list[list[int]] | None:
        """The record field: None when every token is of one version (the field is then left out)."""
        runs = [[v, n] for v, n in self.runs if n]
        return runs if len({v for v, _ in runs}) > 1 else None


@dataclass(kw_only=True)
class Rewarded(Trajectory):
    """A trajectory with its reward (``streamrl.rewarded``). ``reward`` is fp32-exact."""

    SCHEMA: ClassVar[str] = REWARDED_SCHEMA

    reward: float
    reward_info: dict[str, Any] = field(default_factory=dict)
    scorer: dict[str, Any] = field(default_factory=dict)  # {"name": ..., "version": ...}
    scored_at: float = field(default_factory=_now)
    schema: str = REWARDED_SCHEMA

    @classmethod
    def from_trajectory(cls, traj: Trajectory, *, reward: float, reward_info: dict[str, Any],
                        scorer: dict[str, Any]) -> "Rewarded":
        base = {f.name: getattr(traj, f.name) for f in fields(Trajectory) if f.name != "schema"}
        return cls(**base, reward=float(np.float32(reward)), reward_info=reward_info, scorer=scorer)


@dataclass(kw_only=True)
class Distilled(Rewarded):
    """A trajectory with the teacher's log-probs per response token (``streamrl.distilled``, the
    teacher stage's output; the learner's input when ``distillation.enabled``). A rewarded record
    with task rewards; without them (``use_task_rewards: false``) ``reward`` is 0 and ``scorer``
    names none. ``teacher_topk`` 0: ``teacher_logprobs`` holds one log-prob per response token,
    the teacher's of the sampled token (the KL-estimator losses); k: ``teacher_logprobs`` and
    ``teacher_ids`` hold k per token, row-major (``forward_kl_topk``)."""

    SCHEMA: ClassVar[str] = DISTILLED_SCHEMA

    teacher_logprobs: TokenArray
    teacher_ids: TokenArray | None = None
    teacher_topk: int = 0
    teacher: dict[str, Any] = field(default_factory=dict)  # {"model", "backend", "version"}
    annotated_at: float = field(default_factory=_now)
    schema: str = DISTILLED_SCHEMA

    @classmethod
    def annotate(cls, record: Trajectory, *, logprobs: np.ndarray, ids: np.ndarray | None, topk: int,
                 teacher: dict[str, Any]) -> "Distilled":
        """``record`` (rewarded, or a bare trajectory: reward 0, ``scorer`` none) with the
        teacher's annotation."""
        base = {f.name: getattr(record, f.name) for f in fields(Trajectory) if f.name != "schema"}
        if isinstance(record, Rewarded):
            base.update(reward=record.reward, reward_info=record.reward_info, scorer=record.scorer,
                        scored_at=record.scored_at)
        else:
            base.update(reward=0.0, reward_info={"status": "no_task_reward"}, scorer={"name": "none", "version": "0"})
        return cls(**base, teacher_logprobs=logprobs, teacher_ids=ids, teacher_topk=topk, teacher=teacher)


@dataclass(kw_only=True)
class Prompt(_Record):
    """One prompt for one epoch (``streamrl.prompts``); a rollout worker samples ``group_size``
    trajectories from it, all carrying its ``group_id``."""

    SCHEMA: ClassVar[str] = PROMPT_SCHEMA

    group_id: str
    group_size: int
    data_source: str
    prompt: str | list[dict[str, Any]]
    ground_truth: str | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    created_at: float = field(default_factory=_now)
    schema: str = PROMPT_SCHEMA

    @property
    def key(self) -> bytes:
        return self.group_id.encode()


@dataclass(kw_only=True)
class PolicyVersion(_Record):
    """A new policy version announced by the learner (``streamrl.policy``, compacted)."""

    SCHEMA: ClassVar[str] = POLICY_SCHEMA

    version: int
    weights_uri: str | None = None  # where the weights are (a directory or file URI)
    # LoRA (learner.lora): weights_uri is then a PEFT adapter directory, to apply on the base
    # weights at base_uri (Hugging Face layout); None: weights_uri holds full weights
    base_uri: str | None = None
    trained_records: int = 0  # records the learner has trained on, all time
    metrics: dict[str, float] = field(default_factory=dict)
    # The training line: a learner restarted from a checkpoint older than the versions already
    # announced starts a new one, and drops records generated by the abandoned versions.
    lineage: str | None = None
    # The run's last version (learner.versions reached, or the data exhausted): the eval stage
    # evaluates it whatever ``eval.every``, and then ends.
    final: bool = False
    # learner.weights_delta: this version is the XOR of its weights against version
    # ``delta_base``'s (the one before), on the chain from the full version ``delta_full``;
    # None (or absent): a full version (streamrl.weights.delta)
    delta_base: int | None = None
    delta_full: int | None = None
    created_at: float = field(default_factory=_now)
    schema: str = POLICY_SCHEMA

    @property
    def key(self) -> bytes:
        return b"policy"


@dataclass(kw_only=True)
class DeadLetter(_Record):
    """A message that failed for good, with its original bytes (``streamrl.deadletter``)."""

    SCHEMA: ClassVar[str] = DEADLETTER_SCHEMA

    stage: str
    reason: str
    detail: str = ""
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None
    original_key_b64: str | None = None
    original_value_b64: str | None = None
    record_id: str | None = None
    created_at: float = field(default_factory=_now)
    schema: str = DEADLETTER_SCHEMA

    @property
    def key(self) -> bytes | None:
        return None

    @classmethod
    def size_limit(cls, record_limit: int) -> int:
        """A dead letter carries a whole record in base64 (4/3 of it) plus its story: the
        dead-letter topic allows twice the record limit, so even an oversize record's bytes fit."""
        return 2 * record_limit + 64 * 1024

    @classmethod
    def for_message(cls, *, stage: str, reason: str, detail: str, topic: str | None,
                    partition: int | None, offset: int | None, key: bytes | None,
                    value: bytes | None, record_id: str | None = None) -> "DeadLetter":
        b64 = lambda b: None if b is None else pybase64.b64encode_as_string(b)  # noqa: E731
        return cls(stage=stage, reason=reason, detail=detail[:2000], source_topic=topic,
                   source_partition=partition, source_offset=offset, original_key_b64=b64(key),
                   original_value_b64=b64(value), record_id=record_id)

    def original_value(self) -> bytes | None:
        return None if self.original_value_b64 is None else pybase64.b64decode(self.original_value_b64)


@dataclass(kw_only=True)
class EvalResult(_Record):
    """One policy version's validation on one data source (``streamrl.eval``), by the eval stage:
    verl's ``process_validation_metrics`` figures (``streamrl.evaluation.scores``) under
    ``<variable>/<metric>`` names, which the trackers log as ``val-core/<data_source>/...``."""

    SCHEMA: ClassVar[str] = EVAL_SCHEMA

    version: int
    data_source: str
    n: int  # responses per prompt
    prompts: int  # prompts evaluated
    metrics: dict[str, float] = field(default_factory=dict)
    failed: int = 0  # responses not generated or not scored: out of the metrics, counted here
    core: str = "reward"  # the variable verl puts under val-core/ (acc where the scorer gives it)
    seed: int = 0
    lineage: str | None = None
    created_at: float = field(default_factory=_now)
    schema: str = EVAL_SCHEMA

    @property
    def key(self) -> bytes:
        return f"{self.version}/{self.data_source}".encode()


#: The topics and the record type each carries: declared here, once. A record's topic is its
#: type's (``topic_of``): ``Rewarded`` is a ``Trajectory`` but travels on ``rewarded``.
PROMPTS: Topic[Prompt] = Topic("prompts", Prompt)
ROLLOUTS: Topic[Trajectory] = Topic("rollouts", Trajectory)
REWARDED: Topic[Rewarded] = Topic("rewarded", Rewarded)
POLICY: Topic[PolicyVersion] = Topic("policy", PolicyVersion)
DEADLETTER: Topic[DeadLetter] = Topic("deadletter", DeadLetter)
EVAL: Topic[EvalResult] = Topic("eval", EvalResult)
DISTILLED: Topic[Distilled] = Topic("distilled", Distilled)
TOPICS: tuple[Topic, ...] = (PROMPTS, ROLLOUTS, REWARDED, POLICY, DEADLETTER, EVAL, DISTILLED)
_TOPIC_OF: dict[type, Topic] = {t.record: t for t in TOPICS}


def topic_of(record: "_Record | type[_Record]") -> Topic:
    """The topic a record (or record type) travels on, by its exact type."""
    cls = record if isinstance(record, type) else type(record)
    try:
        return _TOPIC_OF[cls]
    except KeyError:
        raise TypeError(f"{cls.__name__} has no topic (records.TOPICS)") from None


RECORD_TYPES: dict[str, type[_Record]] = {
    cls.SCHEMA: cls for cls in (Trajectory, Rewarded, Prompt, PolicyVersion, DeadLetter, EvalResult, Distilled)
}


def decode_any(data: bytes | None, types: Sequence[type[_Record]] = tuple(RECORD_TYPES.values()),
               max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> _Record:
    """A message of one of ``types``, picked by its ``schema`` field (replaying a topic that
    may hold trajectories or rewarded records, say), or ``RecordError``."""
    obj = _parse(data, max_bytes)
    cls = {t.SCHEMA: t for t in types}.get(obj.get("schema"))
    if cls is None:
        raise RecordError("schema", f"schema is {obj.get('schema')!r}, expected one of "
                                    f"{', '.join(repr(t.SCHEMA) for t in types)}")
    return cls.from_dict(obj)


def as_plain(record: _Record) -> dict[str, Any]:
    """A record as plain Python with token arrays as lists, for reports and tests."""
    out = asdict(record)  # type: ignore[call-overload]
    for name, dtype in _ARRAY_DTYPES.items():
        if out.get(name) is not None:
            out[name] = unpack_array(out[name], dtype, name).tolist()
    return out
