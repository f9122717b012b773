"""Learner checkpoints, written: weights, optimizer state, version, consumer offsets and the
de-duplication window, saved together so they always agree. Every stage reads them through
``streamrl.resume`` (``LearnerState``, ``latest_good``), below the stages.

Layout: ``<checkpoint_dir>/ckpt-<seq>/`` holding ``policy/`` (Hugging Face layout, safetensors:
``load_policy`` reads it; with ``learner.lora`` the adapter in PEFT's layout, the base being
``learner.policy``), ``optimizer.pt`` (tensors only; read back with
``torch.load(weights_only=True)``, which refuses arbitrary pickled objects) and ``state.json``
(version, offsets, de-dup window, counters, lineage). A checkpoint is written into a hidden
sibling directory, every file fsync'd, and renamed into place (the directory fsync'd too): a crash
mid-write leaves the previous one as the latest. The previous ones (``keep``) stay as fallbacks:
``resume.latest_good`` skips a checkpoint that cannot be read. The learner writes ``dcp/`` (model and
optimizer as ``torch.distributed.checkpoint`` shards, one per rank, readable by any number of
ranks: ``ModelState.write_checkpoint``, the trainer's) in place of ``optimizer.pt``, which older
checkpoints have. ``ModelState`` also writes what rollout workers load each version
(``save_weights``; with LoRA the adapter, on the base ``save_base`` wrote once).

Why the offsets live here and not only in Kafka: the weights and the offsets must describe the
same moment. On restart the learner seeks to these offsets, so the records consumed after the
checkpoint come back and are trained again (their updates were lost with the process), and
the ones before it do not; records that were finished but sit after the lowest unfinished
offset come back too, and the de-dup window saved alongside skips them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from streamrl.errors import StorageFull, storage_full
from streamrl.resume import NAME, LearnerState, checkpoints, latest, policy_dir

if TYPE_CHECKING:
    from streamrl.learner.config import LearnerConfig


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | Path, model: Any, tokenizer: Any, optimizer_state: dict[str, Any] | None,
         state: LearnerState, keep: int = 2, write: Callable[[Path], None] | None = None) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep``. ``write``: writes
    the weights and optimizer into the directory instead (``ModelState.write_checkpoint``: ``policy/``
    and the ranks' ``torch.distributed.checkpoint`` shards in ``dcp/``)."""
    import torch

    from streamrl.weights import save_policy

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    last = latest(root)
    seq = int(NAME.match(last.name).group(1)) + 1 if last else 1
    final = root / f"ckpt-{seq:08d}"
    for stale in root.glob(".ckpt-*.tmp*"):  # half-written by a writer that died (a full disk, a kill)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    tmp.mkdir()
    try:
        if write is not None:
            write(tmp)
        else:
            save_policy(model, tokenizer, policy_dir(tmp))
            torch.save(optimizer_state, tmp / "optimizer.pt")
        state.created_at = time.time()
        with open(tmp / "state.json", "w") as f:
            json.dump(asdict(state), f)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # what it took is given back: the previous one stays the latest
        raise
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def full_storage_stops(what: str, version: int, where: str, knob: str, leftovers: Path | None = None) -> Any:
    """A write that finds its storage full (``errors.storage_full``) stops the learner with one
    line naming the path (``StorageFull``: exit 2, so the run stops rather than restarting it
    into the same wall). Nothing is lost: the records since the last checkpoint are read again
    on ``--resume``. ``leftovers``: a directory whose half-written siblings are removed."""
    try:
        yield
    except Exception as exc:
        if not storage_full(exc):
            raise
        if leftovers is not None:  # what the failed write took (``save_policy``'s temporary sibling)
            for part in leftovers.parent.glob(f".{leftovers.name}.tmp*"):
                shutil.rmtree(part, ignore_errors=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageFull(f"learner: {what} {version} did not fit in {where} ({first[:200]}): free space there "
                          f"(or lower {knob}), then resume the run (`streamrl run --resume`); what was "
                          "trained since the last checkpoint is trained again from its records") from exc


def load_optimizer_state(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    import torch

    return torch.load(Path(path) / "optimizer.pt", map_location=device, weights_only=True)


class Owner(Protocol):
    """What ``ModelState`` reads of the trainer that holds it (``Trainer``; not imported: the
    trainer imports this module). Read at each call: a test may hand the trainer another config."""

    cfg: "LearnerConfig"
    model: Any
    tokenizer: Any
    optimizer: Any
    device: Any
    rank: int
    sharded: bool
    lora: bool  # learner.lora on: the adapter is what trains and is saved
    critic: Any  # adv_estimator gae's value model, saved and loaded beside the policy (or None)

    def _lead(self, op: str, payload: Any) -> None:
        """Rank 0: have the other ranks join the collective that follows."""


class ModelState:
    """The trainer's model and optimizer on disk, on every rank of a group alike (rank 0 writes
    the whole files, each rank its shards): the weights rollout workers load each version, the
    LoRA base once, a checkpoint's ``policy/`` and ``dcp/``. The whole weights gathered from the
    shards are kept until ``forget`` (each step), as the weights and a checkpoint of one
    version both need them."""

    def __init__(self, owner: Owner):
        self.owner = owner
        self._full_state: dict[str, Any] | None = None  # gathered once per version (weights + checkpoint)
        self._adapter: dict[str, Any] | None = None  # the adapter's, likewise (LoRA)

    def forget(self) -> None:
        """The weights changed (a step): what was gathered is stale."""
        self._full_state = self._adapter = None

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's weights on rank 0's CPU (gathered from the shards; once per version:
        kept until the next step). Every rank must call it; the others get ``{}``."""
        if not self.owner.sharded:
            return self.owner.model.state_dict()
        if self._full_state is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            self._full_state = get_model_state_dict(
                self.owner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self._full_state

    def adapter_state_dict(self) -> dict[str, Any]:
        """LoRA: the adapter's tensors whole on rank 0's CPU (gathered from the shards, only the
        adapter's bytes; once per version). Every rank must call it."""
        if self._adapter is None:
            from streamrl.learner import lora

            self._adapter = lora.adapter_state(self.owner.model)
        return self._adapter

    def save_weights(self, directory: str | Path) -> Path:
        """What rollout workers load, at ``directory``, written by rank 0: the weights in Hugging
        Face layout (safetensors); with LoRA the adapter alone in PEFT's layout (on the base
        ``save_base`` wrote), or the base merged with it (``learner.lora.merge_for_servers``)."""
        from streamrl.weights import save_policy

        self.owner._lead("weights", str(directory).encode())
        started = time.perf_counter()
        path = Path(directory)
        if self.owner.lora:
            from streamrl.learner import lora

            if self.owner.cfg.lora.merge_for_servers:
                state = self.full_state_dict()
                if self.owner.rank == 0:
                    path = save_policy(lora.base_model(self.owner.model), self.owner.tokenizer, directory,
                                       state_dict=lora.merged_state(self.owner.model, state))
            else:
                state = self.adapter_state_dict()
                if self.owner.rank == 0:
                    path = lora.save_adapter(self.owner.model, directory, state)
        elif not self.owner.sharded:
            path = save_policy(self.owner.model, self.owner.tokenizer, directory)
        else:
            state = self.full_state_dict()
            if self.owner.rank == 0:
                path = save_policy(self.owner.model, self.owner.tokenizer, directory, state_dict=dict(state))
        from streamrl import metrics

        metrics.LEARNER_WEIGHTS_PUBLISH_SECONDS.observe(time.perf_counter() - started)
        return path

    def save_base(self, directory: str | Path) -> Path:
        """LoRA: the frozen base in Hugging Face layout (with the tokenizer) at ``directory``, by
        rank 0; the adapters published each version apply to it. Written once per start."""
        from streamrl.learner import lora
        from streamrl.weights import save_policy

        self.owner._lead("base", str(directory).encode())
        state = self.full_state_dict() if self.owner.sharded else self.owner.model.state_dict()
        if self.owner.rank == 0:
            save_policy(lora.base_model(self.owner.model), self.owner.tokenizer, directory,
                        state_dict=lora.base_state(self.owner.model, state))
        self._full_state = None  # (gathered for this alone: not kept)
        return Path(directory)

    def _dcp_options(self) -> Any:
        """LoRA: the DCP shards hold what trains (adapters) and its optimizer state, not the
        frozen base (it is the configured policy, loaded as at the first start)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.owner.lora, strict=not self.owner.lora)

    def write_checkpoint(self, directory: str | Path) -> None:
        """Into a checkpoint being written (``learner.checkpoint.save``): the weights as
        ``policy/`` (Hugging Face layout, rank 0; with LoRA the adapter, PEFT's layout) and model
        + optimizer state as sharded ``torch.distributed.checkpoint`` files in ``dcp/`` (each
        rank its shard; they load on any number of ranks)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from streamrl.weights import save_policy

        self.owner._lead("checkpoint", str(directory).encode())
        directory = Path(directory)
        if self.owner.lora:
            from streamrl.learner import lora

            state = self.adapter_state_dict()
            if self.owner.rank == 0:
                lora.save_adapter(self.owner.model, policy_dir(directory), state)
        elif not self.owner.sharded:
            save_policy(self.owner.model, self.owner.tokenizer, policy_dir(directory))
        else:
            state = self.full_state_dict()
            if self.owner.rank == 0:
                save_policy(self.owner.model, self.owner.tokenizer, policy_dir(directory), state_dict=dict(state))
        options = self._dcp_options()
        state = {"model": get_model_state_dict(self.owner.model, options=options)}
        if self.owner.optimizer.state:  # (asking a fresh optimizer for its state would take a step)
            state["optim"] = get_optimizer_state_dict(self.owner.model, self.owner.optimizer, options=options)
        with single_process_dcp():
            dcp.save(state, checkpoint_id=str(directory / "dcp"))
            if self.owner.critic is not None:  # its weights and AdamW states, sharded as the policy's
                self.owner.critic.save(directory / "critic_dcp")

    def load_checkpoint(self, directory: str | Path) -> None:
        """Model and optimizer state from a checkpoint's ``dcp/`` (written by any number of
        ranks), or its ``optimizer.pt`` (single-process checkpoints of earlier versions)."""
        directory = Path(directory)
        if (directory / "dcp").is_dir():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                                 set_model_state_dict, set_state_dict)

            path = str(directory / "dcp")
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            options = self._dcp_options()
            with single_process_dcp():
                if any(k.startswith("optim.") for k in saved):
                    model_sd, optim_sd = get_state_dict(self.owner.model, self.owner.optimizer, options=options)
                    state = {"model": model_sd, "optim": optim_sd}
                    dcp.load(state, checkpoint_id=path)
                    set_state_dict(self.owner.model, self.owner.optimizer, model_state_dict=state["model"],
                                   optim_state_dict=state["optim"], options=options)
                else:
                    state = {"model": get_model_state_dict(self.owner.model, options=options)}
                    dcp.load(state, checkpoint_id=path)
                    set_model_state_dict(self.owner.model, state["model"], options=options)
            if self.owner.critic is not None and (directory / "critic_dcp").is_dir():
                with single_process_dcp():
                    self.owner.critic.load(directory / "critic_dcp")
        elif (directory / "optimizer.pt").is_file():
            import torch

            self.owner.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location=self.owner.device,
                                                      weights_only=True))


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP without a process group is the single-process learner's normal case, not a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
