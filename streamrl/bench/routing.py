"""``streamrl bench routing``: what MoE router replay (``streamrl.routing``) costs and buys, side by
side in one run.

- ``record``: a trajectory record's bytes and its encode + decode time without and with the
  routing of a realistic shape (default a 30B-A3B: 48 layers x top-8 of 128 experts, 512 prompt +
  1024 response tokens).
- ``perturbed`` / ``bf16``: a tiny Qwen2-MoE on CPU samples (the rollout's weights perturbed by
  ``--noise`` of each tensor's std, or the learner's weights in bf16), the learner (fp32, the
  unperturbed weights) recomputes the log-probs with its own routing and replaying the rollout's
  (R3): the fraction of (token, layer) rows routed to other experts, and the mean |log-prob
  difference| over the response tokens, without and with replay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from streamrl.bench import harness

HELP = "MoE router replay: record bytes with/without routing, and the rollout/learner mismatch with/without replay"

PROMPTS = ["The cat sat on", "Two plus two is", "Once upon a time", "Kafka topics hold",
           "Experts route tokens", "A tiny model says", "Replay the router", "Sampling at one"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=48, help="record shape: MoE layers (30B-A3B: 48)")
    parser.add_argument("--topk", type=int, default=8, help="record shape: experts per token (30B-A3B: 8)")
    parser.add_argument("--experts", type=int, default=128, help="record shape: experts per layer (30B-A3B: 128)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--noise", type=float, default=0.03, help="the rollout's weights' perturbation (x std)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tiny MoE: tokens sampled per response")
    parser.add_argument("--samples", type=int, default=2, help="tiny MoE: responses per prompt (8 prompts)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", default="", help="write routing.json here")
    parser.add_argument("--quick", action="store_true", help="fewer codec repeats")


class RoutingBench(harness.Bench):
    name = "routing"
    variants = ("record", "perturbed", "bf16")

    def __init__(self, args: argparse.Namespace):
        import torch

        super().__init__(args)
        torch.set_num_threads(args.threads)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        from streamrl.policy import byte_tokenizer, perturb, tiny_moe_model

        with tempfile.TemporaryDirectory(prefix="streamrl-routing-") as tmp:
            self.tmp = Path(tmp)
            tok = byte_tokenizer()
            for name, noise in (("learner", 0.0), ("rollout", self.args.noise)):
                model = tiny_moe_model(len(tok))
                if noise:
                    perturb(model, noise)
                model.save_pretrained(self.tmp / name)
                tok.save_pretrained(self.tmp / name)
            self.trainer = self.cfg = None
            yield

    def measure(self, variant: str, round: int) -> dict[str, float]:
        return self._record() if variant == "record" else self._mismatch(variant)

    def _record(self) -> dict[str, float]:
        from streamrl.records import Trajectory
        from streamrl.routing import pack

        a, rng = self.args, np.random.default_rng(0)
        p, r = a.prompt_tokens, a.response_tokens
        base = dict(group_id="g", group_size=8, policy_version=1, data_source="gsm8k", prompt="x" * 4 * p,
                    response="y" * 4 * r, prompt_ids=rng.integers(0, 150_000, p).astype(np.int32),
                    response_ids=rng.integers(0, 150_000, r).astype(np.int32),
                    response_logprobs=rng.normal(-1, 1, r).astype(np.float32))
        flat, shape = pack(rng.integers(0, a.experts, (p + r - 1, a.layers, a.topk)), a.experts)
        records = {"without": Trajectory(**base), "with": Trajectory(**base, routed_experts=flat,
                                                                     routed_experts_shape=shape)}
        out: dict[str, float] = {}
        repeats = 5 if a.quick else 21
        times: dict[str, list[float]] = {k: [] for k in records}
        for _ in range(repeats):  # alternated: load on a shared machine falls on both alike
            for name, rec in records.items():
                started = time.perf_counter()
                data = rec.encode()
                decoded = Trajectory.decode(data)
                decoded.array("routed_experts") if name == "with" else None
                times[name].append(time.perf_counter() - started)
                out[f"bytes_{name}"] = len(data)
        for name in records:
            out[f"codec_ms_{name}"] = statistics.median(times[name]) * 1e3
        return out

    def _trainer(self):
        from streamrl.learner.config import LearnerConfig
        from streamrl.learner.trainer import Trainer

        if self.trainer is None:
            self.cfg = LearnerConfig(policy=str(self.tmp / "learner"), router_replay="R3",
                                     checkpoint_dir=str(self.tmp / "ckpt"), weights_dir=str(self.tmp / "w")).validate()
            self.trainer = Trainer(self.cfg)
        return self.cfg, self.trainer

    def _mismatch(self, variant: str) -> dict[str, float]:
        from streamrl.learner.samples import to_samples
        from streamrl.records import Rewarded
        from streamrl.rollout.backends import SamplingParams
        from streamrl.rollout.backends.transformers_engine import TransformersBackend
        from streamrl.routing import pack

        a = self.args
        policy, dtype = (self.tmp / "rollout", "float32") if variant == "perturbed" else (self.tmp / "learner", "bfloat16")
        engine = TransformersBackend(str(policy), dtype=dtype, seed=0, return_routed_experts=True)
        params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, ignore_eos=True)
        completions = [c for g in asyncio.run(engine.generate(PROMPTS, a.samples, params)) for c in g]
        records = []
        for i, c in enumerate(completions):
            flat, shape = pack(c.routed_experts)
            records.append(Rewarded.decode(Rewarded(
                id=f"r{i}", group_id=f"g{i // a.samples}", group_size=a.samples, policy_version=0, data_source="b",
                prompt="p", response=c.text, prompt_ids=np.asarray(c.prompt_ids, np.int32),
                response_ids=np.asarray(c.response_ids, np.int32), response_logprobs=c.response_logprobs,
                routed_experts=flat, routed_experts_shape=shape, reward=0.0, reward_info={},
                scorer={"name": "b", "version": "1"}).encode()))
        cfg, trainer = self._trainer()
        samples = to_samples(records, cfg, trainer)
        out = {}
        for replay in (False, True):
            lp, routes, rows = mismatch(trainer, samples, replay)
            key = "with" if replay else "without"
            out[f"logprob_diff_{key}"], out[f"routing_differs_{key}"], out["rows"] = lp, routes, rows
        return out

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        a, one = self.args, runs.single()
        rec = one["record"]
        tokens = a.prompt_tokens + a.response_tokens
        out: dict[str, Any] = {
            "shape": f"{a.layers} layers x top-{a.topk} of {a.experts}, {a.prompt_tokens}+{a.response_tokens} tokens",
            "record_bytes_without": rec["bytes_without"], "record_bytes_with": rec["bytes_with"],
            "bytes_ratio": round(rec["bytes_with"] / rec["bytes_without"], 1),
            "routing_bytes_per_token": round((rec["bytes_with"] - rec["bytes_without"]) / tokens, 1),
            "codec_ratio": round(rec["codec_ms_with"] / rec["codec_ms_without"], 1)}
        for variant in ("perturbed", "bf16"):
            m = one[variant]
            out[variant] = {k: round(v, 5) if isinstance(v, float) else v for k, v in m.items()}
        return out

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        print(f"record ({summary['shape']}): {summary['record_bytes_without']} B without routing, "
              f"{summary['record_bytes_with']} B with (x{summary['bytes_ratio']}, "
              f"{summary['routing_bytes_per_token']} B/token; encode+decode x{summary['codec_ratio']})", file=sys.stderr)
        for variant in ("perturbed", "bf16"):
            m = summary[variant]
            print(f"{variant:10s} routing differs {m['routing_differs_without']:.1%} -> {m['routing_differs_with']:.1%}"
                  f", mean |logprob diff| {m['logprob_diff_without']:.4f} -> {m['logprob_diff_with']:.4f} "
                  f"({m['rows']} token x layer rows)", file=sys.stderr)


def mismatch(trainer: Any, samples: list, replay: bool) -> tuple[float, float, int]:
    """(mean |rollout - learner log-prob| over the response tokens, the fraction of (token, layer)
    rows whose experts differ from the rollout's, rows compared), one sequence a pass, the
    learner's routing replayed from the records (R3) or its own."""
    import dataclasses

    import torch

    from streamrl.routing import find_routers

    used: dict[int, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, args, out, layer=layer: used.__setitem__(layer, out[2].detach()))
               for layer, m in find_routers(trainer.model)]  # after the tap's hook: what the routers used
    diffs, differ, rows = [], 0, 0
    try:
        for s in samples:
            (lp,) = trainer.logprobs([s if replay else dataclasses.replace(s, routed_experts=None)])
            diffs.append(np.abs(lp - s.behaviour_logprobs))
            want = torch.from_numpy(s.routed_experts.astype(np.int64))
            for layer, got in used.items():
                got = got[:len(want)].sort(-1).values
                differ += int((got != want[:, layer].sort(-1).values).any(-1).sum())
                rows += len(want)
    finally:
        for h in handles:
            h.remove()
    return float(np.concatenate(diffs).mean()), differ / max(rows, 1), rows


def main(args: argparse.Namespace) -> int:
    return harness.run(RoutingBench(args))
