"""``streamrl bench weights``: versions published by delta (``learner.weights_delta``,
``streamrl.weights.delta``) against full versions, on a real model shape trained by the
project's learner at RL learning rates.

A Qwen2-shaped policy built from its config (random weights, no download: ``m120``, 123M
parameters, by default; ``qwen0.5b`` Qwen2.5-0.5B's 494M) is trained by ``Trainer.step`` on
rewarded records (random tokens, rewards in groups of four, through the learner's own
``to_samples``) for ``--versions`` versions, once per dtype (``learner.dtype``: the published
dtype) and learning rate. Each version is written full (``save_weights``, timed: the full
version's write) and published by ``DeltaWriter`` as the XOR against the version before (timed:
the encode, checksums included); a reader holding the version before rebuilds it from the delta
(``apply_version``: the delta file read, decoded, applied to the held bytes, the checksum checked;
timed: the reconstruct) and the full file is read back (timed: the full read, from the page
cache, the fastest a full version is ever read), and the rebuilt bytes are compared with the
full ones bit by bit. Reported per case, side by side in one run: delta bytes over full bytes
(mean over the deltas), the bits that differ (summed over every rebuilt version: 0), the
reconstruct time over the full read's, and each time per GB.

Goal (issue 58): bf16 at lr 1e-6, delta bytes <= 5 % of full, reconstruct faster than reading
the full version, 0 bits different."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.bench import harness

HELP = "versions by delta against full versions: bytes, encode and reconstruct time, bit-exactness (ratios, one run)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 versions per case at lr 1e-6 (default 20, lr 1e-6 and 1e-5)")
    parser.add_argument("--versions", type=int, default=0, help="versions trained per case (after version 0)")
    parser.add_argument("--model", default="m120", choices=["m120", "qwen0.5b", "small"],
                        help="the policy's shape (small: 19M parameters, for the bench's own test, not its figures)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="published dtypes (learner.dtype)")
    parser.add_argument("--lrs", default="", help="learning rates (default 1e-6,1e-5; --quick 1e-6)")
    parser.add_argument("--level", type=int, default=1, help="zstd level (learner.weights_delta_level)")
    parser.add_argument("--sequences", type=int, default=8, help="records per version (groups of 4)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", default="", help="directory for weights.json (the JSON line, indented)")


def _records(rng: np.random.Generator, n: int, version: int) -> list[Any]:
    from streamrl.records import Rewarded

    out = []
    for i in range(n):
        prompt, response = rng.integers(0, 256, 16).tolist(), rng.integers(0, 256, 32).tolist()
        out.append(Rewarded(id=f"v{version}-{i}", group_id=f"v{version}-g{i // 4}", group_size=4,
                            policy_version=version, data_source="bench", prompt="", response="",
                            prompt_ids=prompt, response_ids=response,
                            response_logprobs=np.full(len(response), -5.5, np.float32),
                            reward=float(rng.random()), reward_info={}, scorer={"name": "bench"}))
    return out


def _bits_different(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> int:
    if set(a) != set(b):
        return -1
    total = 0
    for name in a:
        if a[name].size != b[name].size:
            return -1
        total += int(np.bitwise_count(np.bitwise_xor(a[name], b[name])).sum())
    return total


class WeightsBench(harness.Bench):
    """One variant per (dtype, lr), one round: every variant trains its own chain."""

    name = "weights"
    seconds_key = "seconds"

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.versions = args.versions or (3 if args.quick else 20)
        lrs = args.lrs or ("1e-6" if args.quick else "1e-6,1e-5")
        self.variants = [(d, float(lr)) for d in args.dtypes.split(",") for lr in lrs.split(",")]
        self.units = self.versions
        self.work = Path(tempfile.mkdtemp(prefix="streamrl-bench-weights-"))
        self.params = 0
        print(f"bench weights: {args.model}, {self.versions} versions per case, cases {self.variants}",
              file=sys.stderr, flush=True)

    def measure(self, variant: tuple[str, float], round: int) -> dict[str, Any]:
        import torch

        from streamrl.bench.learner_speed import build_policy
        from streamrl.learner.config import LearnerConfig
        from streamrl.learner.samples import to_samples
        from streamrl.learner.trainer import Trainer
        from streamrl.weights import delta

        dtype, lr = variant
        torch.set_num_threads(self.args.threads)
        root = self.work / f"{dtype}-{lr:g}"
        policy = build_policy(self.args.model, root / "policy")
        cfg = LearnerConfig(device="cpu", lr=lr, dtype=dtype, micro_batch_size=self.args.sequences, policy=policy)
        trainer = Trainer(cfg)
        self.params = sum(p.numel() for p in trainer.model.parameters())
        writer = delta.DeltaWriter(full_every=self.versions + 2, level=self.args.level)
        rng = np.random.default_rng(0)
        rows: list[dict[str, float]] = []
        held: delta.Held | None = None
        for version in range(self.versions + 1):
            if version:
                trainer.step(to_samples(_records(rng, self.args.sequences, version - 1), cfg, trainer))
            target = root / "weights" / f"v{version}"
            started = time.perf_counter()
            trainer.save_weights(target)
            write_s = time.perf_counter() - started
            started = time.perf_counter()
            full = {f.name: np.fromfile(f, dtype=np.uint8) for f in delta.weight_files(target)}
            read_s = time.perf_counter() - started
            full_bytes = sum(b.nbytes for b in full.values())
            published = writer.publish(target, version)
            manifest = delta.read_manifest(target)
            assert manifest is not None
            if held is None:
                held = delta.Held(version, manifest["checksum"], {n: b.copy() for n, b in full.items()})
            else:
                started = time.perf_counter()
                delta.apply_version(held, target, manifest)
                rebuild_s = time.perf_counter() - started
                held.version, held.checksum = version, manifest["checksum"]
                rows.append({"share": published.weight_bytes / full_bytes, "bits": _bits_different(held.files, full),
                             "encode_s": published.encode_seconds, "rebuild_s": rebuild_s, "read_s": read_s,
                             "write_s": write_s, "gb": full_bytes / 1e9})
                self.progress.update(1)
            shutil.rmtree(target)  # (the bytes live on in memory; the disk holds one version at a time)
        shutil.rmtree(root, ignore_errors=True)
        last = rows[-1]
        self.note(f"{dtype} lr {lr:g}: delta {100 * statistics.mean(r['share'] for r in rows):.2f}% of full, "
                  f"{sum(r['bits'] for r in rows)} bits different, reconstruct {last['rebuild_s']:.3f} s, "
                  f"full read {last['read_s']:.3f} s")
        return {"rows": rows}

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        cases = []
        for (dtype, lr), results in runs.items():
            rows = results[0]["rows"]
            gb = statistics.mean(r["gb"] for r in rows)
            med = {k: statistics.median(r[k] for r in rows) for k in ("encode_s", "rebuild_s", "read_s", "write_s")}
            cases.append({
                "dtype": dtype, "lr": lr,
                "delta_over_full": round(statistics.mean(r["share"] for r in rows), 5),
                "delta_over_full_max": round(max(r["share"] for r in rows), 5),
                "bits_different": int(sum(r["bits"] for r in rows)),
                "reconstruct_over_full_read": round(med["rebuild_s"] / med["read_s"], 3),
                "encode_over_full_write": round(med["encode_s"] / med["write_s"], 3),
                "full_gb": round(gb, 4),
                "encode_s_per_gb": round(med["encode_s"] / gb, 3),
                "reconstruct_s_per_gb": round(med["rebuild_s"] / gb, 3),
                "full_read_s_per_gb": round(med["read_s"] / gb, 3),
                "full_write_s_per_gb": round(med["write_s"] / gb, 3),
                "deltas": len(rows),
            })
        goal = next((c for c in cases if c["dtype"] == "bfloat16" and c["lr"] == 1e-6), None)
        return {
            "bench": "weights", "model": self.args.model, "parameters": self.params, "versions": self.versions,
            "zstd_level": self.args.level, "cases": cases,
            "goal_met": None if goal is None else bool(goal["delta_over_full"] <= 0.05 and goal["bits_different"] == 0
                                                       and goal["reconstruct_over_full_read"] < 1.0),
        }

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        rows = [[c["dtype"], f"{c['lr']:g}", f"{100 * c['delta_over_full']:.2f}%", c["bits_different"],
                 c["reconstruct_over_full_read"], c["reconstruct_s_per_gb"], c["full_read_s_per_gb"],
                 c["encode_s_per_gb"], c["full_write_s_per_gb"]] for c in summary["cases"]]
        print(harness.table(["dtype", "lr", "delta/full", "bits diff", "rebuild/read", "rebuild s/GB", "read s/GB",
                             "encode s/GB", "write s/GB"], rows), file=sys.stderr)
        shutil.rmtree(self.work, ignore_errors=True)


def main(args: argparse.Namespace) -> int:
    return harness.run(WeightsBench(args))
