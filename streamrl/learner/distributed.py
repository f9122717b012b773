"""The learner as N ranks of one ``torch.distributed`` group (``learner.parallel.nproc``).

- Start: ``streamrl learner`` with ``nproc > 1`` runs torch's elastic launcher
  (``torch.distributed.run``, ``--max-restarts 0``) which starts N copies of the same command
  with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set; a rank that dies makes the launcher stop the
  others and exit non-zero, and the supervisor of ``streamrl run`` (or Kubernetes, or Ray)
  restarts the whole group from the last checkpoint.
- Roles: rank 0 is the learner stage of today (the one Kafka consumer, staleness, groups,
  checkpoints, offsets, versions); the other ranks follow: they wait for rank 0's
  commands on the group (``Channel``; ``follower.follow``) and run the same collective (a step on
  the mini-batch, a weights gather, a checkpoint) with it. Mini-batches travel as bytes in a
  small format of our own (``encode_samples``: a JSON header and raw arrays), never
  pickled.
- Sharding: FSDP2 ``fully_shard`` per decoder layer and at the root (``shard``), mixed precision
  and CPU offload from the config. gloo on CPU (torch 2.13's gloo has the all-gather and
  reduce-scatter FSDP2 uses), NCCL on CUDA.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from streamrl.errors import ConfigError
from streamrl.learner.samples import Sample

if TYPE_CHECKING:
    from streamrl.learner.config import LearnerConfig

log = logging.getLogger(__name__)

#: the commands rank 0 sends the followers
OPS = ("init", "step", "logprobs", "weights", "checkpoint", "stop", "base", "version")


@dataclass
class Group:
    rank: int
    world: int
    local_rank: int
    device: str

    @property
    def leader(self) -> bool:
        return self.rank == 0


_GROUP: Group | None = None


def launched() -> bool:
    """This process is one rank started by torch's launcher (torchrun / torch.distributed.run)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def current() -> Group | None:
    """The group this process belongs to (None: a single-process learner)."""
    return _GROUP


def init(cfg: "LearnerConfig") -> Group | None:
    """Join the group when started by the launcher (once per process); None otherwise."""
    global _GROUP
    if _GROUP is not None or not launched():
        return _GROUP
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    device = cfg.device
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    backend = process_group_backend(cfg.parallel.backend or ("nccl" if device.startswith("cuda") else "gloo"))
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s))
    _GROUP = Group(dist.get_rank(), dist.get_world_size(), local_rank, device)
    log.info("learner: rank %d of %d (%s on %s)", _GROUP.rank, _GROUP.world, backend, device)
    return _GROUP


def process_group_backend(backend: str) -> str:
    """NCCL moves CUDA tensors only; the commands of ``Channel`` and the plan's pass counts are
    CPU tensors, so with NCCL the group also gets gloo for the CPU ones (``cpu:gloo,cuda:nccl``)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def finish() -> None:
    """Rank 0: tell the followers to leave; every rank: leave the group."""
    global _GROUP
    if _GROUP is None:
        return
    import torch.distributed as dist

    if _GROUP.leader:
        Channel().send("stop")
    dist.destroy_process_group()
    _GROUP = None


# -- rank 0 -> the others ---------------------------------------------------------------------
class Channel:
    """Commands from rank 0 over the group: a header ``[op, payload length]`` broadcast, then
    the payload bytes. Every rank calls it in the same order (rank 0 ``send``, others ``receive``)."""

    def send(self, op: str, payload: bytes = b"") -> None:
        import torch
        import torch.distributed as dist

        dist.broadcast(torch.tensor([OPS.index(op), len(payload)], dtype=torch.int64), src=0)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)

    def receive(self) -> tuple[str, bytes]:
        import torch
        import torch.distributed as dist

        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0)
        op, n = OPS[int(header[0])], int(header[1])
        if not n:
            return op, b""
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0)
        return op, buf.numpy().tobytes()


# -- the wire format of mini-batches between ranks -------------------------------------------
_ARRAYS = (("prompt_ids", np.int64), ("response_ids", np.int64),
           ("behaviour_logprobs", np.float32), ("response_mask", np.float32),
           ("teacher_logprobs", np.float32), ("teacher_ids", np.int64))


def encode_samples(samples: Sequence[Sample]) -> bytes:
    """Samples as bytes: a JSON header (ids, rewards, array lengths) and the arrays' raw bytes."""
    header, blobs = [], []
    for s in samples:
        entry: dict[str, Any] = {"id": s.id, "group_id": s.group_id, "reward": s.reward,
                                 "policy_version": s.policy_version, "teacher_topk": s.teacher_topk}
        for name in ("reward_components", "reward_baseline"):  # (optional: absent when None)
            if getattr(s, name) is not None:
                entry[name] = getattr(s, name)
        if s.routed_experts is not None:  # router replay R3: [rows, layers, topk], sent flat
            entry["route_shape"] = list(s.routed_experts.shape)
            blobs.append(np.ascontiguousarray(s.routed_experts, dtype=np.int32).tobytes())
        for name, dtype in _ARRAYS:
            value = getattr(s, name)
            if value is None:
                entry[name] = None
                continue
            arr = np.ascontiguousarray(value, dtype=dtype)
            entry[name] = len(arr)
            blobs.append(arr.tobytes())
        header.append(entry)
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def decode_samples(data: bytes) -> list[Sample]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    pos, out = 8 + n, []
    for entry in header:
        arrays = {}
        shape = entry.pop("route_shape", None)
        if shape is not None:  # (sent before the sample's other arrays)
            count = int(np.prod(shape))
            arrays["routed_experts"] = np.frombuffer(data, dtype=np.int32, count=count, offset=pos).reshape(shape).copy()
            pos += count * 4
        for name, dtype in _ARRAYS:
            count = entry.pop(name)
            if count is None:
                arrays[name] = None
                continue
            size = count * np.dtype(dtype).itemsize
            arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=pos).copy()
            pos += size
        out.append(Sample(**entry, **arrays))
    return out


# -- sharding ---------------------------------------------------------------------------------
def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of a Hugging Face causal LM (``model.model.layers`` for Llama/Qwen;
    the ``_no_split_modules`` classes otherwise)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None:
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(model: Any, cfg: "LearnerConfig", trainable: bool = True, offload: bool | None = None) -> Any:
    """FSDP2: ``fully_shard`` on each decoder layer, then on the root. Mixed precision from
    ``param_dtype``/``reduce_dtype`` (parameters are kept in ``dtype``: the fp32 master copy),
    ``parallel.cpu_offload`` (or ``offload``: the critic's own) keeps the shards and optimizer
    states in host memory."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if cfg.param_dtype or cfg.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, cfg.param_dtype) if cfg.param_dtype else None,
            reduce_dtype=getattr(torch, cfg.reduce_dtype) if cfg.reduce_dtype else None)
    if cfg.parallel.cpu_offload if offload is None else offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # a PEFT model (learner.lora): its decoder layers are the wrapped model's; each one's
    # adapters are sharded with it
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in decoder_layers(inner):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if not trainable:
        model.requires_grad_(False)
    return model


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard, a plain tensor whole)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


# -- memory -----------------------------------------------------------------------------------
def count_parameters(policy: str, seed: int = 0, lora: Any = None, overrides: dict | None = None) -> int:
    """Parameters of ``policy`` counted on the meta device (nothing allocated, nothing loaded),
    its config changed by ``overrides`` (``learner.override_config``: its sizes) as the
    learner loads it; ``lora`` (a ``LoraConfig`` that is on): the adapters' parameters instead
    (what trains)."""
    import torch

    from streamrl.policy import TINY_SPEC, apply_overrides, byte_tokenizer, tiny_model

    with torch.device("meta"):
        if policy == TINY_SPEC:
            model = tiny_model(len(byte_tokenizer()), seed=seed, overrides=overrides)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(policy.removeprefix("file://"), local_files_only=True)
            apply_overrides(config, overrides or {}, "learner.override_config")
            model = AutoModelForCausalLM.from_config(config)
        if lora is not None:
            from streamrl.learner.lora import wrap

            model = wrap(model, lora)
    seen, total = set(), 0
    for p in model.parameters():  # tied weights once
        if lora is not None and not p.requires_grad:
            continue
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def estimate_bytes(n_params: int, cfg: "LearnerConfig", world: int, trainable: int | None = None) -> dict[str, int]:
    """Bytes per rank for parameters, gradients and AdamW's two moments (all sharded over the
    ``world`` ranks, in ``dtype``; a KL reference adds its parameters; ``trainable``: the
    parameters that train, LoRA's adapters, when not all). Activations are not in it (they
    depend on the token budget and gradient checkpointing)."""
    import torch

    size = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    per = -(-n_params // world)
    grad = -(-(n_params if trainable is None else trainable) // world)
    out = {"parameters": per * size + (0 if trainable is None else grad * size),
           "gradients": grad * size, "optimizer": 2 * grad * size}
    if cfg.kl_coef > 0 and not cfg.lora.enabled:  # (LoRA's reference is the base itself)
        out["reference"] = per * size
    out["total"] = sum(out.values())
    return out


def check_memory(cfg: "LearnerConfig", policy: str, world: int) -> dict[str, int]:
    """Log the estimate; refuse (``ConfigError``, one line) when ``max_memory_gb`` cannot hold it."""
    from streamrl.policy import model_overrides

    overrides = model_overrides(cfg.override_config)
    trainable = count_parameters(policy, cfg.seed, cfg.lora, overrides) if cfg.lora.enabled else None
    est = estimate_bytes(count_parameters(policy, cfg.seed, overrides=overrides), cfg, world, trainable)
    gb = {k: v / 2**30 for k, v in est.items()}
    if _GROUP is None or _GROUP.leader:
        mb = {k: v / 2**20 for k, v in est.items()}
        log.info("learner: memory per rank (%d ranks): %.1f MB parameters + %.1f MB gradients + "
                    "%.1f MB optimizer states%s = %.1f MB before activations", world, mb["parameters"],
                    mb["gradients"], mb["optimizer"],
                    f" + {mb['reference']:.1f} MB reference" if "reference" in mb else "", mb["total"])
    if cfg.max_memory_gb and gb["total"] > cfg.max_memory_gb:
        raise ConfigError(f"config field 'learner.max_memory_gb': {gb['total']:.3g} GB per rank needed for "
                          f"parameters, gradients and optimizer states with {world} rank(s), more than "
                          f"{cfg.max_memory_gb} (raise learner.parallel.nproc or the limit)")
    return est


# -- the launcher -----------------------------------------------------------------------------
def launch(cfg: "LearnerConfig", argv: Sequence[str]) -> int:
    """Run ``python -m streamrl <argv>`` as ``parallel.nproc`` ranks on this node through
    torch's elastic launcher (single node: a standalone rendezvous on a free port). No restarts
    here: a failed rank ends the group, and whoever supervises this process restarts it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args = ["--nproc-per-node", str(cfg.parallel.nproc), "--max-restarts", "0"]
    if cfg.parallel.nnodes == 1:
        args.append("--standalone")
    else:
        raise ConfigError("config field 'learner.parallel.nnodes': several nodes are started by torchrun "
                          "on each node (see docs/guides/distributed-learner.md), not by streamrl learner")
    print(f"learner: {cfg.parallel.nproc} ranks through torch.distributed.run", file=sys.stderr, flush=True)
    try:
        with _stop_by_draining():
            torchrun([*args, *_agent_signals(), "--module", "streamrl", *argv])
    except ChildFailedError as exc:
        print(f"learner: a rank failed: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


#: the signals that stop a learner cleanly (docs/guides/lifecycle.md: every stage drains and exits 0 on them)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _agent_signals() -> list[str]:
    """The elastic agent's options that leave SIGTERM and SIGINT to us (``_stop_by_draining``);
    an older torch without that option keeps its agent's handling (exit 1 on a stop)."""
    from torch.distributed.run import get_args_parser

    options = {o for action in get_args_parser()._actions for o in action.option_strings}
    if "--signals-to-handle" not in options:
        return []
    return ["--signals-to-handle", ",".join(n for n in ("SIGHUP", "SIGQUIT") if hasattr(signal, n))]


@contextlib.contextmanager
def _stop_by_draining() -> Iterator[None]:
    """SIGTERM / SIGINT to the launcher: a clean stop of the group, exit 0. torch's elastic agent
    would turn them into a ``SignalException`` (exit 1, a traceback) and SIGKILL the ranks 30 s
    later, whatever rank 0 was writing. Instead the agent is told to leave them alone
    (``_agent_signals``) and the launcher passes SIGTERM to its ranks: rank 0 drains,
    checkpoints and says stop; the others ignore signals and leave on that stop
    (``follower.follow``); the agent then sees every rank exit 0."""
    before = {sig: signal.signal(sig, _forward_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _forward_stop(signum: int, frame: Any) -> None:
    """The launcher's handler: SIGTERM to each rank (a Ctrl-C reached them already from the
    terminal; a second stop signal changes nothing: rank 0 is draining)."""
    pids = child_pids()
    print(f"learner: {signal.Signals(signum).name}: stopping {len(pids)} rank(s), rank 0 drains",
          file=sys.stderr, flush=True)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def child_pids() -> list[int]:
    """This process's children (Linux ``/proc``: the ranks the elastic agent started)."""
    out: list[int] = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))
