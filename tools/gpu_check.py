#!/usr/bin/env python3
"""The learner and the reward model on one NVIDIA GPU, in one command (``make gpu-check``),
within 8 minutes, on a machine with no network whose Python already has torch (CUDA),
transformers, peft, pyarrow and numpy.

Prepare the wheels here (a machine with network), for the GPU machine's Python (3.11 below;
~47 MB, no vLLM), and copy them there with this checkout::

    python -m pip download --no-deps --only-binary=:all: --python-version 3.11 \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \\
        -d gpu-wheels -r tools/gpu_check_wheels.txt

On the GPU machine, from the checkout's root::

    make gpu-check WHEELS=gpu-wheels            # or: python tools/gpu_check.py --wheels gpu-wheels

What it does:

1. installs the wheels (``pip install --no-index --find-links``), checks the imports, and
   runs streamrl from this checkout (``PYTHONPATH``);
2. ``streamrl bench learner`` on CUDA in bf16 with FSDP2 on one rank, for a ~0.5B-parameter
   Qwen2-shaped model with random weights built from its config (Qwen2.5-0.5B's shape, no
   download), padded and packed, against the bare loop, on RL-shaped lengths (responses drawn
   log-uniformly from 32 to 2,048 tokens);
3. ``streamrl bench reward`` on CUDA: dynamic batching against offline batches (and serial),
   for a MiniLM-L6-shaped reward model with random weights (the real weights' wheel is 80 MB);
4. writes ``OUT/gpu_check.json`` (the two benches' summaries, the device, the versions, the
   time taken) and ``OUT/learner.png``, ``OUT/reward.png``.

``--device cpu``: the same steps with small models, for a machine without a GPU (how this
script is tested where no GPU is lent). Exit 0 when every step ran and the learner's loss
equals bare's (the same update); the ratios themselves are reported, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS_LIST = ROOT / "tools" / "gpu_check_wheels.txt"
BUDGET_S = 480.0  # the whole check, installs included
NEEDED = ("torch", "transformers", "peft", "pyarrow", "numpy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--wheels", default="", help="a folder of the wheels listed in tools/gpu_check_wheels.txt")
    parser.add_argument("--out", default="runs/gpu-check", help="where the JSON and the plots go")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    missing = [m for m in NEEDED if not _importable(m)]
    if missing and not (args.device == "cpu" and missing == ["peft"]):  # peft: not used by the check itself
        return _fail(f"this Python lacks {', '.join(missing)} (the check expects them installed)")
    if args.wheels:
        _step("install the wheels", _install, Path(args.wheels))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    device = _step("check the device", _device, args.device)
    learner = _step("bench learner", _bench_learner, args.device, out, env, started)
    reward = _step("bench reward", _bench_reward, args.device, out, env, started)
    summary = {"device": device, "elapsed_s": round(time.monotonic() - started, 1), "budget_s": BUDGET_S,
               "learner": learner, "reward": reward}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    _step("plots", _plots, learner, reward, out, device["name"])
    print(f"gpu-check: {out / 'gpu_check.json'} in {summary['elapsed_s']:.0f} s", flush=True)
    errors = [p for p, r in learner["paths"].items() if r["loss_rel_error"] > _tolerance(learner["dtype"])]
    if errors:
        return _fail(f"the learner's loss differs from bare's on {', '.join(errors)}: not the same update")
    if summary["elapsed_s"] > BUDGET_S:
        return _fail(f"took {summary['elapsed_s']:.0f} s, more than {BUDGET_S:.0f}")
    return 0


def _step(name: str, fn, *args):
    t = time.monotonic()
    print(f"gpu-check: {name} ...", flush=True)
    result = fn(*args)
    print(f"gpu-check: {name}: {time.monotonic() - t:.1f} s", flush=True)
    return result


def _fail(why: str) -> int:
    print(f"gpu-check: FAILED: {why}", file=sys.stderr, flush=True)
    return 1


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _install(wheels: Path) -> None:
    """streamrl's dependencies from the folder, no index; then streamrl's imports must work."""
    if not wheels.is_dir():
        raise SystemExit(f"gpu-check: --wheels {wheels}: no such folder")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                    "-r", str(WHEELS_LIST)], check=True)
    subprocess.run([sys.executable, "-c", "import streamrl.cli, streamrl.bench.learner_speed, streamrl.bench.reward"],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _device(device: str) -> dict:
    import torch
    import transformers

    info = {"kind": device, "torch": torch.__version__, "transformers": transformers.__version__}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu-check: no CUDA device here (run with --device cpu to test the script)")
        info["name"] = torch.cuda.get_device_name(0)
        info["memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["flash_attn"] = _importable("flash_attn")
    else:
        info["name"] = "cpu"
    return info


def _run(argv: list[str], env: dict, started: float, share: float) -> dict:
    """``python -m streamrl ARGV``: its last stdout line is the JSON summary. Bounded by a share
    of what is left of the budget."""
    left = BUDGET_S - (time.monotonic() - started)
    proc = subprocess.run([sys.executable, "-m", "streamrl", *argv], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, timeout=max(60.0, left * share))
    if proc.returncode:
        raise SystemExit(f"gpu-check: streamrl {' '.join(argv)}: exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bench_learner(device: str, out: Path, env: dict, started: float) -> dict:
    if device == "cuda":
        argv = ["--model", "qwen0.5b", "--dtype", "bfloat16", "--sequences", "64", "--response-max", "2048",
                "--max-tokens", "8192", "--steps", "3"]
    else:
        argv = ["--model", "mini", "--sequences", "8", "--response-max", "512", "--steps", "1", "--threads", "1",
                "--clock", "cpu"]  # a CPU shared with other work: its own CPU time
    return _run(["bench", "learner", "--device", device, "--fsdp", "--response-min", "32", *argv,
                 "--json", str(out / "learner.json")], env, started, 0.6)


def _bench_reward(device: str, out: Path, env: dict, started: float) -> dict:
    model = _reward_model(out / "reward-model")
    if device == "cuda":
        argv = ["--batch-size", "64", "--rounds", "3"]
    else:
        argv = ["--quick", "--short-records", "64", "--long-records", "16", "--rounds", "2",
                "--judge-requests", "320"]
    return _run(["bench", "reward", "--device", device, "--model", str(model), *argv], env, started, 0.9)


def _reward_model(directory: Path) -> Path:
    """A MiniLM-L6-shaped sequence classifier (6 layers, hidden 384) with random weights and the
    byte-level tokenizer: the shape of the bundled reward model, none of its 80 MB."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    sys.path.insert(0, str(ROOT))
    from streamrl.policy import byte_tokenizer

    torch.manual_seed(0)
    tok = byte_tokenizer()
    config = BertConfig(vocab_size=len(tok), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, num_labels=1,
                        pad_token_id=tok.pad_token_id)
    BertForSequenceClassification(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _tolerance(dtype: str) -> float:
    return 1e-4 if dtype == "float32" else 5e-2


def _plots(learner: dict, reward: dict, out: Path, device: str) -> None:
    sys.path.insert(0, str(ROOT))
    from streamrl.plotting import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    paths = list(learner["paths"])
    for k, who in enumerate(("learner", "bare")):
        ax.bar([i + 0.4 * k for i in range(len(paths))], [learner["paths"][p][f"{who}_tokens_per_s"] for p in paths],
               width=0.4, label=who)
    ax.set_xticks([i + 0.2 for i in range(len(paths))], paths)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"learner vs bare, {learner['model']} {learner['dtype']} on {device}", fontsize=9)
    ax.legend()
    save(fig, out / "learner.png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    kinds, ways = ("short", "long"), ("batched", "serial", "offline")
    for k, way in enumerate(ways):
        ax.bar([i + 0.27 * k for i in range(2)], [reward[f"{kind}_{way}_per_s"] for kind in kinds],
               width=0.27, label=way)
    ax.set_xticks([i + 0.27 for i in range(2)], kinds)
    ax.set_ylabel("records / s")
    ax.set_title(f"reward model: dynamic batching vs serial vs offline on {device}", fontsize=9)
    ax.legend()
    save(fig, out / "reward.png")


if __name__ == "__main__":
    sys.exit(main())
