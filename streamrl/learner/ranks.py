"""The ranks other than 0 of a learner group (``learner.parallel.nproc`` > 1): each builds its
``Trainer`` when rank 0 says from which checkpoint, then joins every collective rank 0 leads
(``Trainer._lead``: a step, a weights gather, a checkpoint) until it says stop. Apart from
``distributed`` (the group, the wire format) because it drives a ``Trainer``, which uses
``distributed``: one module holding both would import itself in a circle."""

from __future__ import annotations

import json
import signal

import torch.distributed as dist

from streamrl.learner import distributed
from streamrl.learner.config import LearnerConfig
from streamrl.learner.trainer import Trainer


def follow(cfg: LearnerConfig) -> int:
    """A rank other than 0: build the trainer when rank 0 says from which checkpoint, then run
    what it sends until it says stop. SIGTERM and SIGINT are ignored (the launcher passes
    SIGTERM to every rank at a stop, a terminal's Ctrl-C reaches every process of its group;
    rank 0 drains and checkpoints, which needs this rank, then says stop); a dead rank 0 fails
    the next collective and ends this process."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    group = distributed.init(cfg)
    assert group is not None and not group.leader
    channel = distributed.Channel()
    trainer: Trainer | None = None
    while True:
        op, payload = channel.receive()
        if op == "init":
            trainer = Trainer(cfg, **json.loads(payload))
        elif op == "stop":
            break
        elif trainer is None:
            raise RuntimeError(f"learner rank {group.rank}: {op!r} before init")
        elif op == "step":
            trainer.step(distributed.decode_samples(payload))
        elif op == "logprobs":
            trainer.logprobs(distributed.decode_samples(payload))
        elif op == "weights":
            trainer.save_weights(payload.decode())
        elif op == "checkpoint":
            trainer.write_checkpoint(payload.decode())
        elif op == "base":
            trainer.save_base(payload.decode())
        elif op == "version":
            trainer.set_version(int(payload))
    dist.destroy_process_group()
    return 0
