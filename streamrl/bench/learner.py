"""``streamrl bench learner``: what one learner update costs per 1k response tokens, for the tiny
policy of the local default and a small one (hidden 512, 8 layers, ~19M parameters), measured
side by side in one run on the same synthetic mini-batch shape (real GRPO steps of
``streamrl.learner.trainer.Trainer``: forward, loss, backward, AdamW).

``--nproc 1,2``: the learner on 1 and on N FSDP2 ranks (``torch.distributed``, gloo on CPU,
NCCL on CUDA) on the same mini-batches, in one run: step time, each rank's parameter +
optimizer-state bytes, and the parity error (loss and weights) of N ranks against 1."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HELP = "learner update cost per 1k response tokens (tiny vs a small model, one run)"

MODELS = {"tiny": (64, 2), "small": (512, 8)}  # hidden size, layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--sequences", type=int, default=16, help="sequences per mini-batch")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--nproc", default="", help="rank counts to compare, e.g. 1,2 (FSDP2); empty: tiny vs small")
    parser.add_argument("--model", default="small", choices=sorted(MODELS), help="the model of --nproc")


def measure(name: str, args: argparse.Namespace, steps: int, workdir: Path) -> dict[str, float]:
    import numpy as np
    import torch

    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.trainer import Sample, Trainer
    from streamrl.policy import byte_tokenizer, save_policy, tiny_model

    hidden, layers = MODELS[name]
    tokenizer = byte_tokenizer()
    path = save_policy(tiny_model(len(tokenizer), hidden_size=hidden, layers=layers), tokenizer, workdir / name)
    trainer = Trainer(LearnerConfig(device=args.device, lr=1e-4, micro_batch_size=8), policy=str(path))
    params = sum(p.numel() for p in trainer.model.parameters())
    rng = np.random.default_rng(0)
    samples = [Sample(id=str(i), group_id=str(i // 8), reward=float(rng.random()), policy_version=0,
                      prompt_ids=rng.integers(0, 256, args.prompt_tokens),
                      response_ids=rng.integers(0, 256, args.response_tokens),
                      behaviour_logprobs=np.full(args.response_tokens, -5.5, np.float32))
               for i in range(args.sequences)]
    times, tokens = [], 0.0
    for _ in range(steps + 1):  # the first step warms up (allocations, kernels)
        out = trainer.step(samples)
        times.append(out["step_seconds"])
        tokens = out["tokens"]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
    step_s = statistics.median(times[1:])
    return {"params_m": round(params / 1e6, 2), "step_s": round(step_s, 4), "response_tokens": int(tokens),
            "s_per_1k_tokens": round(step_s / tokens * 1000, 4)}


def _samples(args: argparse.Namespace, seed: int) -> list:
    """A mini-batch of uneven lengths (what the token balancing is for)."""
    import numpy as np

    from streamrl.learner.trainer import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(args.sequences):
        r = int(rng.integers(args.response_tokens // 4, args.response_tokens + 1))
        out.append(Sample(id=f"{seed}-{i:03d}", group_id=f"{seed}-{i // 8}", reward=float(rng.random()),
                          policy_version=0, prompt_ids=rng.integers(0, 256, args.prompt_tokens),
                          response_ids=rng.integers(0, 256, r), behaviour_logprobs=np.full(r, -5.5, np.float32)))
    return out


def _parallel_rank(rank: int, world: int, port: int, args: argparse.Namespace, policy: str, out: str) -> None:
    """One rank of the ``--nproc`` bench (rank 0 drives, the others follow as in the learner)."""
    import os

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, args.threads // world))
    from streamrl.learner import distributed

    cfg = _parallel_cfg(args)
    if rank:
        from streamrl.learner.trainer import follow

        follow(cfg)
        return
    from streamrl.learner.trainer import Trainer

    trainer = Trainer(cfg, policy=policy)
    result = _parallel_steps(trainer, args)
    trainer.save_weights(Path(out) / "weights")
    (Path(out) / "result.json").write_text(json.dumps(result))
    distributed.finish()


def _parallel_cfg(args: argparse.Namespace):
    from streamrl.learner.config import LearnerConfig

    return LearnerConfig(device=args.device, lr=1e-4, micro_batch_size=8).validate()


def _parallel_steps(trainer, args: argparse.Namespace) -> dict:
    from streamrl.learner.distributed import local_bytes

    steps = 3 if args.quick else 6
    losses, times = [], []
    for seed in range(steps + 1):  # the first step warms up
        out = trainer.step(_samples(args, seed))
        losses.append(out["loss"])
        times.append(out["step_seconds"])
    optim = [v for st in trainer.optimizer.state.values() for v in st.values() if v.dim() > 0]
    return {"losses": losses, "step_s": round(statistics.median(times[1:]), 4),
            "param_bytes": local_bytes(trainer.model.parameters()), "optimizer_bytes": local_bytes(optim)}


def parallel(args: argparse.Namespace) -> int:
    """1 vs N ranks on the same mini-batches, in one run."""
    import torch
    import torch.multiprocessing as mp

    from streamrl.learner.trainer import Trainer
    from streamrl.net import free_port
    from streamrl.policy import byte_tokenizer, load_policy, save_policy, tiny_model

    counts = sorted({int(n) for n in args.nproc.split(",") if n.strip()})
    hidden, layers = MODELS[args.model]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = byte_tokenizer()
        policy = str(save_policy(tiny_model(len(tok), hidden_size=hidden, layers=layers), tok, Path(tmp) / "policy"))
        reference = None
        for n in counts:
            if n == 1:
                torch.set_num_threads(args.threads)
                trainer = Trainer(_parallel_cfg(args), policy=policy)
                r = _parallel_steps(trainer, args)
                reference = (r["losses"], {k: v.clone() for k, v in trainer.model.state_dict().items()})
            else:
                out = Path(tmp) / f"n{n}"
                out.mkdir()
                port = free_port()
                mp.spawn(_parallel_rank, args=(n, port, args, policy, str(out)), nprocs=n, join=True)
                r = json.loads((out / "result.json").read_text())
                if reference is not None:
                    weights = load_policy(str(out / "weights"))[0].state_dict()
                    r["loss_rel_error"] = max(abs(a - b) / max(abs(b), 1e-8) for a, b in zip(r["losses"], reference[0]))
                    r["weight_max_abs_error"] = max(float((weights[k] - v).abs().max()) for k, v in reference[1].items())
            r["mb_per_rank"] = round((r["param_bytes"] + r["optimizer_bytes"]) / 2**20, 3)
            results[str(n)] = r
            print(f"{n} rank(s): {r['step_s']:.3f} s per step, {r['mb_per_rank']:.2f} MB params+optimizer per rank"
                  + (f", loss rel. error {r['loss_rel_error']:.2e}, weights max abs error {r['weight_max_abs_error']:.2e}"
                     if "loss_rel_error" in r else ""), file=sys.stderr, flush=True)
    summary: dict = {"device": args.device, "threads": args.threads, "model": args.model,
                     "sequences": args.sequences, "ranks": {n: {k: v for k, v in r.items() if k != "losses"}
                                                            for n, r in results.items()}}
    if "1" in results:
        for n, r in results.items():
            if n != "1":
                summary[f"memory_{n}_over_1"] = round(r["mb_per_rank"] / results["1"]["mb_per_rank"], 3)
                summary[f"step_{n}_over_1"] = round(r["step_s"] / results["1"]["step_s"], 3)
    print(json.dumps(summary), flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    import torch

    if args.nproc:
        return parallel(args)
    torch.set_num_threads(args.threads)
    steps = 3 if args.quick else 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            results[name] = measure(name, args, steps, Path(tmp))
            r = results[name]
            print(f"{name:6s} {r['params_m']:6.2f}M params: {r['step_s']:.3f} s per step of "
                  f"{r['response_tokens']} response tokens -> {r['s_per_1k_tokens']:.3f} s per 1k", file=sys.stderr)
    summary = {"device": args.device, "threads": args.threads, **results,
               "small_over_tiny": round(results["small"]["step_s"] / results["tiny"]["step_s"], 2)}
    print(json.dumps(summary), flush=True)
    return 0
