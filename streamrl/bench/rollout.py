"""``streamrl bench rollout``: tokens/s of the transformers rollout backend (the tiny policy on
CPU here, or ``--device cuda``), one prompt at a time against concurrent prompts merged into one
engine call, alternated over rounds in one run. Each row samples ``--samples`` responses of
``--new-tokens`` tokens per prompt from GSM8K-length prompts (~300 byte tokens)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from typing import Any, AsyncIterator

from streamrl.bench import harness

HELP = "transformers rollout backend tokens/s: serial prompts vs merged concurrent prompts (one run)"

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Let's think step by step and "
          "output the final answer after \"####\".")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--policy", default="tiny", help="'tiny' or a Hugging Face directory")
    parser.add_argument("--prompts", type=int, default=4, help="concurrent prompts in the merged run")
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt (group size)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=0, help="default 5; --quick 2")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true")


async def _tokens_per_s(backend, prompts: int, n: int, params, merged: bool) -> float:
    started = time.perf_counter()
    if merged:
        results = await asyncio.gather(*[backend.generate([PROMPT], n, params) for _ in range(prompts)])
    else:
        results = [await backend.generate([PROMPT], n, params) for _ in range(prompts)]
    elapsed = time.perf_counter() - started
    tokens = sum(len(s.response_ids) for r in results for group in r for s in group)
    return tokens / elapsed


class RolloutBench(harness.Bench):
    """Rounds alternate one prompt of one sample, the prompts one at a time, and the prompts
    merged; medians."""

    name = "rollout"
    variants = ("single", "serial", "merged")
    seconds_key = None

    def __init__(self, args: argparse.Namespace):
        import torch

        super().__init__(args)
        torch.set_num_threads(args.threads)
        self.rounds = args.rounds or (2 if args.quick else 5)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        from streamrl.rollout.backends import SamplingParams
        from streamrl.rollout.backends.transformers_engine import TransformersBackend

        a = self.args
        self.backend = TransformersBackend(a.policy, device=a.device, max_batch_rows=a.prompts * a.samples)
        self.params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)
        await _tokens_per_s(self.backend, 1, a.samples, self.params, merged=False)  # warm-up
        try:
            yield
        finally:
            await self.backend.close()

    async def measure(self, variant: str, round: int) -> float:
        prompts, n = (1, 1) if variant == "single" else (self.args.prompts, self.args.samples)
        return await _tokens_per_s(self.backend, prompts, n, self.params, merged=variant == "merged")

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        a, med = self.args, {k: runs.median(k) for k in runs}
        return {"device": a.device, "policy": a.policy, "new_tokens": a.new_tokens,
                "single_tokens_per_s": round(med["single"], 1), "serial_tokens_per_s": round(med["serial"], 1),
                "merged_tokens_per_s": round(med["merged"], 1),
                "group_vs_single": round(med["serial"] / med["single"], 2),
                "merged_vs_serial": round(med["merged"] / med["serial"], 2)}

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        a = self.args
        for name, label in (("single", "1 prompt x 1 sample"),
                            ("serial", f"{a.prompts} prompts x {a.samples}, one at a time"),
                            ("merged", f"{a.prompts} prompts x {a.samples}, concurrent (merged)")):
            print(f"{label:40s} {summary[f'{name}_tokens_per_s']:8.0f} tokens/s", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    return harness.run(RolloutBench(args))
