"""``streamrl bench learner``: the learner's GRPO step (``streamrl.learner.trainer.Trainer``:
forward, loss, backward, AdamW) against ``bare``, the same update as the shortest plain
PyTorch/transformers loop over the same mini-batches (``streamrl.bench.bare``), padded and packed
(``learner.use_remove_padding``), on an RL-shaped mix: responses drawn log-uniformly from
``--response-min`` to ``--response-max`` tokens (many short, a long tail). Reported, from one
run with the four measured in turn on each mini-batch: the learner's tokens/s as a ratio to
bare's on the same path, and packed tokens/s as a ratio to padded.

``--shapes``: packed against padded on the default task's shape (the tiny policy, 256 sequences
of 8 to 10 tokens, ``configs/local.yaml``'s micro-batches and epochs) and on the RL-shaped one
(``mini``, log-uniform 32 to 2,048 response tokens), in one run: where packing pays and where
it must not cost (issue 52).

``--models``: what one update costs per 1k response tokens, for the tiny policy of the local
default and a small one (hidden 512, 8 layers, ~19M parameters), side by side on one
mini-batch shape.

``--nproc 1,2``: the learner on 1 and on N FSDP2 ranks (``torch.distributed``, gloo on CPU,
NCCL on CUDA) on the same mini-batches, in one run: step time, each rank's parameter +
optimizer-state bytes, and the parity error (loss and weights) of N ranks against 1.

``--lora 0,8,32``: full fine-tuning (rank 0) against LoRA adapters of each rank
(``learner.lora``, every linear layer) on the same mini-batches, in one run: bytes published per
version (what ``save_weights`` writes: the model, or the adapter), the learner's parameter +
optimizer-state bytes, the optimizer's alone, and the step time, each as a ratio to full
fine-tuning. Default model ``m120``: a Qwen2-shaped 123M-parameter config with random weights."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from streamrl.learner import distributed
from streamrl.learner.config import LearnerConfig, LoraConfig
from streamrl.learner.distributed import local_bytes
from streamrl.net import free_port
from streamrl.policy import byte_tokenizer, load_policy, tiny_model
from streamrl.weights import save_policy

HELP = "the learner's step against a bare PyTorch loop, padded and packed (ratios, one run)"

MODELS = {"tiny": (64, 2), "mini": (128, 4), "small": (512, 8)}  # hidden size, layers
#: Qwen2.5-0.5B's shape (494M parameters, its 151,936-token vocabulary), random weights from the
#: config: what ``make gpu-check`` trains, no download
#: a Qwen2-shaped ~123M-parameter config (a 32k vocabulary, tied embeddings): the LoRA bench's
#: "model of >= 100M parameters", random weights, small enough for a CPU step
M120 = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True)
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                rope_theta=1e6, tie_word_embeddings=True)


def build_policy(name: str, directory: Path, device: str = "cpu") -> str:
    """A random-weight Qwen2-shaped policy saved in Hugging Face layout (byte tokenizer: the
    bench's token ids stay below 256, inside any of these vocabularies)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM


    tok = byte_tokenizer()
    if name == "m120":
        torch.manual_seed(0)
        return str(save_policy(Qwen2ForCausalLM(Qwen2Config(**M120)), tok, directory))
    if name != "qwen0.5b":
        hidden, layers = MODELS[name]
        return str(save_policy(tiny_model(len(tok), hidden_size=hidden, layers=layers), tok, directory))
    torch.manual_seed(0)
    with torch.device(device):  # initialising 0.5B parameters is minutes on a CPU, seconds on a GPU
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B))
    return str(save_policy(model.to(torch.bfloat16), tok, directory))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--sequences", type=int, default=16, help="sequences per mini-batch")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--nproc", default="", help="rank counts to compare, e.g. 1,2 (FSDP2); empty: tiny vs small")
    parser.add_argument("--lora", default="", metavar="RANKS",
                        help="LoRA ranks against full fine-tuning (0), e.g. 0,8,32: bytes per version, "
                             "parameter + optimizer bytes, step time as ratios to full (default model m120)")
    parser.add_argument("--model", default="", choices=["", *sorted(MODELS), "m120", "qwen0.5b"],
                        help="the model (default: small for --nproc, mini against bare)")
    parser.add_argument("--models", action="store_true", help="tiny vs small: cost per 1k response tokens")
    parser.add_argument("--shapes", action="store_true",
                        help="packed vs padded on the default task's shape (tiny policy, digits lengths) and on "
                             "the RL-shaped one (mini, log-uniform lengths), in one run")
    parser.add_argument("--response-min", type=int, default=32, help="shortest response (against bare)")
    parser.add_argument("--response-max", type=int, default=2048, help="longest response (against bare)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="learner.max_tokens_per_micro_batch (0: --micro-batch-size sequences per pass)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="learner.micro_batch_size")
    parser.add_argument("--paths", default="padded,packed", help="padded, packed or both")
    parser.add_argument("--dtype", default="float32", help="learner.dtype (bfloat16 on GPUs)")
    parser.add_argument("--steps", type=int, default=0, help="measured steps (0: 3, --quick 2), after one warm-up")
    parser.add_argument("--json", default="", help="also write the summary to this file")
    parser.add_argument("--fsdp", action="store_true",
                        help="against bare: the learner as FSDP2 on one rank (a torch.distributed group of 1)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: this process's CPU time (with --threads 1, what a machine shared with "
                             "other work still measures fairly); wall: elapsed time")


def measure(name: str, args: argparse.Namespace, steps: int, workdir: Path) -> dict[str, float]:
    import numpy as np
    import torch

    from streamrl.learner.samples import Sample
    from streamrl.learner.trainer import Trainer

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

    from streamrl.learner.samples import Sample

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
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, args.threads // world))

    cfg = _parallel_cfg(args)
    if rank:
        from streamrl.learner.ranks import follow

        follow(cfg)
        return
    from streamrl.learner.trainer import Trainer

    trainer = Trainer(cfg, policy=policy)
    result = _parallel_steps(trainer, args)
    trainer.save_weights(Path(out) / "weights")
    (Path(out) / "result.json").write_text(json.dumps(result))
    distributed.finish()


def _parallel_cfg(args: argparse.Namespace):
    return LearnerConfig(device=args.device, lr=1e-4, micro_batch_size=8).validate()


def _parallel_steps(trainer, args: argparse.Namespace) -> dict:
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

    counts = sorted({int(n) for n in args.nproc.split(",") if n.strip()})
    args.model = args.model or "small"
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


def rl_samples(args: argparse.Namespace, seed: int) -> list:
    """One mini-batch shaped as RL data: groups of 8 responses whose lengths are drawn
    log-uniformly in [response_min, response_max], random rewards and behaviour log-probs."""
    import numpy as np

    from streamrl.learner.samples import Sample

    rng = np.random.default_rng(seed)
    lo, hi = np.log(args.response_min), np.log(args.response_max + 1)
    out = []
    for i in range(args.sequences):
        r = int(np.exp(rng.uniform(lo, hi)))
        out.append(Sample(id=f"{seed}-{i:03d}", group_id=f"{seed}-{i // 8}", reward=float(rng.random()),
                          policy_version=0, prompt_ids=rng.integers(0, 256, args.prompt_tokens),
                          response_ids=rng.integers(0, 256, r),
                          behaviour_logprobs=rng.normal(-5.5, 0.3, r).astype(np.float32)))
    return out


def _bare_cfg(args: argparse.Namespace, packed: bool):
    return LearnerConfig(device=args.device, dtype=args.dtype, lr=1e-5, micro_batch_size=args.micro_batch_size,
                         max_tokens_per_micro_batch=args.max_tokens, use_remove_padding=packed).validate()


def _path_run(args: argparse.Namespace, policy: str, packed: bool, batches: list) -> dict:
    """The learner and bare on one path (padded or packed), alternating on each mini-batch so
    that load on the machine hits both alike; the first mini-batch warms up."""
    import torch

    from streamrl.bench.bare import BareGRPO
    from streamrl.learner import packing
    from streamrl.learner.trainer import Trainer

    cfg = _bare_cfg(args, packed)
    trainer = Trainer(cfg, policy=policy)
    if packed and not trainer.packed:
        raise SystemExit("bench learner: this model cannot pack (see the warning above)")
    model = load_policy(policy, device=str(trainer.device), dtype=cfg.dtype)[0]  # the same weights, plain
    model.to(dtype=getattr(torch, cfg.dtype))
    if packed:
        packing.enable(model)
    bare = BareGRPO(model, str(trainer.device), lr=cfg.lr, weight_decay=cfg.weight_decay, packed=packed,
                    max_tokens=cfg.max_tokens_per_micro_batch, micro_batch_size=cfg.micro_batch_size,
                    clip=cfg.clip_ratio_low, clip_c=cfg.clip_ratio_c, grad_clip=cfg.grad_clip)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def timed(fn: Any, samples: list) -> tuple[float, Any]:
        started = clock()
        result = fn(samples)
        _sync(args.device)
        return clock() - started, result

    learner_s, bare_s, errors, forward = [], [], [], 0
    for k, samples in enumerate(batches):
        if k % 2:  # which goes first alternates: a burst of load does not always hit the same one
            b, (_, loss) = timed(bare.step, samples)
        t, out = timed(trainer.step, samples)
        if not k % 2:
            b, (_, loss) = timed(bare.step, samples)
        learner_s.append(t)
        bare_s.append(b)
        errors.append(abs(loss - out["loss"]) / max(abs(out["loss"]), 1e-8))
        forward = sum(trainer.forward_tokens)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batches[-1])
    lt, bt = statistics.median(learner_s[1:]), statistics.median(bare_s[1:])
    return {"learner_step_s": round(lt, 4), "bare_step_s": round(bt, 4),
            "learner_tokens_per_s": round(tokens / lt, 1), "bare_tokens_per_s": round(tokens / bt, 1),
            "learner_over_bare": round(bt / lt, 3), "step_learner_over_bare": round(lt / bt, 3),
            "loss_rel_error": float(f"{max(errors):.2e}"),
            "forward_tokens_last_step": forward, "tokens_last_step": tokens}


def _one_rank_group() -> None:
    """Make this process rank 0 of 1 (what torch's launcher would set), so that the learner's
    ``Trainer`` joins a group and shards its model with FSDP2."""

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def versus_bare(args: argparse.Namespace) -> int:
    """Learner vs bare, padded and packed, on the same RL-shaped mini-batches, in one run."""
    import torch

    torch.set_num_threads(args.threads)
    name = args.model or "mini"
    steps = args.steps or (2 if args.quick else 3)
    batches = [rl_samples(args, seed) for seed in range(steps + 1)]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    results: dict[str, dict] = {}
    if args.fsdp:
        _one_rank_group()
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(name, Path(tmp) / name, args.device)
        for path in paths:
            r = results[path] = _path_run(args, policy, path == "packed", batches)
            print(f"{path:6s} learner {r['learner_step_s']:.3f} s/step ({r['learner_tokens_per_s']:.0f} tok/s), "
                  f"bare {r['bare_step_s']:.3f} s/step ({r['bare_tokens_per_s']:.0f} tok/s): learner/bare "
                  f"{r['learner_over_bare']:.3f}x, loss rel. error {r['loss_rel_error']:.1e}", file=sys.stderr, flush=True)
    if args.fsdp:
        from streamrl.learner import distributed

        distributed.finish()
    summary: dict = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "clock": args.clock,
                     "model": name, "fsdp_ranks": 1 if args.fsdp else 0,
                     "sequences": args.sequences, "prompt_tokens": args.prompt_tokens,
                     "responses": [args.response_min, args.response_max], "max_tokens": args.max_tokens,
                     "micro_batch_size": args.micro_batch_size, "steps": steps, "paths": results}
    for path, r in results.items():  # tokens/s of the learner over bare's (>= 0.9: the goal), and step times
        summary[f"learner_over_bare_{path}"] = r["learner_over_bare"]
        summary[f"step_learner_over_bare_{path}"] = r["step_learner_over_bare"]
    if "padded" in results and "packed" in results:
        for who in ("learner", "bare"):
            summary[f"{who}_packed_over_padded"] = round(results["packed"][f"{who}_tokens_per_s"]
                                                         / results["padded"][f"{who}_tokens_per_s"], 3)
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _lora_trainer(args: argparse.Namespace, policy: str, rank: int):
    """A learner: full fine-tuning at rank 0, else LoRA of ``rank`` on every linear layer."""
    from streamrl.learner.trainer import Trainer

    cfg = LearnerConfig(device=args.device, dtype=args.dtype, lr=1e-5, micro_batch_size=args.micro_batch_size,
                        max_tokens_per_micro_batch=args.max_tokens,
                        lora=LoraConfig(rank=rank, alpha=2.0 * max(rank, 1))).validate()
    return Trainer(cfg, policy=policy)


def _lora_result(trainer, rank: int, times: list[float], out: Path) -> dict:
    """What one learner costs: bytes it publishes per version (written to ``out``), holds in
    parameters, gradients and optimizer states, and its median step time (the first warms up)."""
    import torch


    trainer.save_weights(out)
    optim = [v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    params = {id(p): p for p in trainer.model.parameters()}.values()
    result = {"rank": rank, "params_m": round(sum(p.numel() for p in params) / 1e6, 2),
              "trainable_m": round(sum(p.numel() for p in trainer.trainable) / 1e6, 3),
              "published_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
              "param_bytes": local_bytes(params), "optimizer_bytes": local_bytes(optim),
              "gradient_bytes": local_bytes(p.grad for p in trainer.trainable if p.grad is not None),
              "step_s": round(statistics.median(times[1:]), 4)}
    result["param_plus_optimizer_bytes"] = result["param_bytes"] + result["optimizer_bytes"]
    return result


def lora(args: argparse.Namespace) -> int:
    """Full fine-tuning against LoRA ranks on the same mini-batches, in one run."""
    import torch

    torch.set_num_threads(args.threads)
    ranks = sorted({int(r) for r in args.lora.split(",") if r.strip()} | {0})  # full fine-tuning: the baseline
    name = args.model or "m120"
    steps = args.steps or (1 if args.quick else 4)
    batches = [_samples(args, seed) for seed in range(steps + 1)]
    results: dict[str, dict] = {}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(name, Path(tmp) / name, args.device)
        trainers = {rank: _lora_trainer(args, policy, rank) for rank in ranks}
        times: dict[int, list[float]] = {rank: [] for rank in ranks}
        for k, samples in enumerate(batches):  # each mini-batch through every learner, the order rotating
            order = ranks[k % len(ranks):] + ranks[:k % len(ranks)]
            for rank in order:
                started = clock()
                trainers[rank].step(samples)
                _sync(args.device)
                times[rank].append(clock() - started)
        for rank in ranks:
            r = results[str(rank)] = _lora_result(trainers.pop(rank), rank, times[rank], Path(tmp) / f"published-{rank}")
            gc.collect()
            print(f"{'full' if not rank else f'LoRA r={rank}':>10}: {r['trainable_m']:.3f}M of {r['params_m']:.1f}M "
                  f"parameters train, {r['published_bytes'] / 2**20:.2f} MB per version, "
                  f"{r['param_plus_optimizer_bytes'] / 2**20:.1f} MB parameters + optimizer "
                  f"({r['optimizer_bytes'] / 2**20:.2f} MB optimizer), {r['step_s']:.3f} s per step",
                  file=sys.stderr, flush=True)
    full = results["0"]
    for r in results.values():
        for key in ("published_bytes", "optimizer_bytes", "param_plus_optimizer_bytes", "step_s"):
            r[f"{key.removesuffix('_s').removesuffix('_bytes')}_over_full"] = (
                round(r[key] / full[key], 4) if full[key] else None)
    summary: dict = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "clock": args.clock,
                     "model": name, "sequences": args.sequences, "prompt_tokens": args.prompt_tokens,
                     "response_tokens": args.response_tokens, "steps": steps, "ranks": results}
    for rank, r in results.items():
        if rank != "0":
            for key in ("published", "optimizer", "param_plus_optimizer", "step"):
                summary[f"r{rank}_{key}_over_full"] = r[f"{key}_over_full"]
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


#: ``--shapes``: (model, sequences per mini-batch, micro_batch_size, ppo_epochs, prompt tokens,
#: response tokens (lo, hi), drawn uniformly or log-uniformly)
SHAPES = {"digits": ("tiny", 256, 64, 4, 7, (1, 3), "uniform"),  # configs/local.yaml's learner
          "rl": ("mini", 16, 8, 1, 32, (32, 2048), "log-uniform")}


def shape_samples(shape: str, seed: int) -> list:
    """One mini-batch of ``shape`` (``SHAPES``): the default task's (a 7-byte prompt, 1 to 3
    response tokens: two digits and end-of-sequence, or fewer) or RL's long mixed lengths."""
    import numpy as np

    from streamrl.learner.samples import Sample

    _, n, _, _, prompt, (lo, hi), draw = SHAPES[shape]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = int(rng.integers(lo, hi + 1)) if draw == "uniform" else int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))
        out.append(Sample(id=f"{seed}-{i:03d}", group_id=f"{seed}-{i // 16}", reward=float(rng.random()),
                          policy_version=0, prompt_ids=rng.integers(0, 256, prompt),
                          response_ids=rng.integers(0, 256, r),
                          behaviour_logprobs=rng.normal(-5.5, 0.3, r).astype(np.float32)))
    return out


def shapes(args: argparse.Namespace) -> int:
    """The learner's step packed against padded on each of ``SHAPES``, the two paths alternating
    on the same mini-batches (which goes first alternates too); the first mini-batch warms up."""
    import torch

    from streamrl.learner.trainer import Trainer

    torch.set_num_threads(args.threads)
    steps = args.steps or (3 if args.quick else 8)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape, (model, _, mbs, epochs, *_rest) in SHAPES.items():
            policy = build_policy(model, Path(tmp) / model, args.device)
            trainers = {path: Trainer(LearnerConfig(device=args.device, dtype=args.dtype, lr=1e-5, micro_batch_size=mbs,
                                                    ppo_epochs=epochs, use_remove_padding=path == "packed").validate(),
                                      policy=policy) for path in ("padded", "packed")}
            times: dict[str, list[float]] = {"padded": [], "packed": []}
            for k in range(steps + 1):
                samples = shape_samples(shape, k)
                for path in (("padded", "packed") if k % 2 else ("packed", "padded")):
                    started = clock()
                    trainers[path].step(samples)
                    _sync(args.device)
                    times[path].append(clock() - started)
            tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in shape_samples(shape, 0))
            med = {path: statistics.median(t[1:]) for path, t in times.items()}
            r = results[shape] = {"model": model, "tokens_per_step": tokens, "padded_step_s": round(med["padded"], 4),
                                  "packed_step_s": round(med["packed"], 4),
                                  "packed_over_padded": round(med["padded"] / med["packed"], 3)}
            print(f"{shape:6s} ({model}, {tokens} tokens a step): padded {r['padded_step_s']:.3f} s, packed "
                  f"{r['packed_step_s']:.3f} s: packed {r['packed_over_padded']:.3f}x padded's speed",
                  file=sys.stderr, flush=True)
    summary = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "clock": args.clock,
               "steps": steps, "shapes": results,
               **{f"{shape}_packed_over_padded": r["packed_over_padded"] for shape, r in results.items()}}
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def main(args: argparse.Namespace) -> int:
    import torch

    if args.shapes:
        return shapes(args)
    if args.lora:
        return lora(args)
    if args.nproc:
        return parallel(args)
    if not args.models:
        return versus_bare(args)
    torch.set_num_threads(args.threads)
    steps = 3 if args.quick else 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiny", "small"):
            results[name] = measure(name, args, steps, Path(tmp))
            r = results[name]
            print(f"{name:6s} {r['params_m']:6.2f}M params: {r['step_s']:.3f} s per step of "
                  f"{r['response_tokens']} response tokens -> {r['s_per_1k_tokens']:.3f} s per 1k", file=sys.stderr)
    summary = {"device": args.device, "threads": args.threads, **results,
               "small_over_tiny": round(results["small"]["step_s"] / results["tiny"]["step_s"], 2)}
    print(json.dumps(summary), flush=True)
    return 0
