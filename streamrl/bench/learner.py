"""``streamrl bench learner``: what one learner update costs per 1k response tokens, for the tiny
policy of the local default and a small one (hidden 512, 8 layers, ~19M parameters), measured
side by side in one run on the same synthetic mini-batch shape (real GRPO steps of
``streamrl.learner.trainer.Trainer``: forward, loss, backward, AdamW)."""

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


def main(args: argparse.Namespace) -> int:
    import torch

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
