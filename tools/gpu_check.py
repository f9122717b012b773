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
4. a quantised rollout (``rollout.quantization: fp8``) on vLLM's engine in process, where this
   Python has vLLM (its wheel is not among the check's: install it beside torch to run this
   step; without it, or without a GPU, the step is skipped and says so in the JSON): a small
   Qwen2-shaped policy with random weights, saved in bf16, sampled greedily by an fp8 engine;
   a second version (other weights) loaded in place, then the first again: the first must give
   back its very tokens and log-probs (the engine quantised each full-precision version as it
   loaded it: ``streamrl.rollout.vllm_extension.load_into``), the second others; the mismatch
   against the bf16 policy's own log-probs (transformers) is reported;
5. writes ``OUT/gpu_check.json`` (the benches' summaries, the device, the versions, the
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
    parser.add_argument("--vllm-fp8-only", action="store_true", help=argparse.SUPPRESS)  # step 4's own process
    args = parser.parse_args(argv)
    if args.vllm_fp8_only:
        print(json.dumps(_vllm_fp8_rollout(Path(args.out))), flush=True)
        return 0
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
    fp8 = _step("vllm fp8 rollout", _vllm_fp8, args.device, out, env, started)
    summary = {"device": device, "elapsed_s": round(time.monotonic() - started, 1), "budget_s": BUDGET_S,
               "learner": learner, "reward": reward, "vllm_fp8_rollout": fp8}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    _step("plots", _plots, learner, reward, out, device["name"])
    print(f"gpu-check: {out / 'gpu_check.json'} in {summary['elapsed_s']:.0f} s", flush=True)
    errors = [p for p, r in learner["paths"].items() if r["loss_rel_error"] > _tolerance(learner["dtype"])]
    if errors:
        return _fail(f"the learner's loss differs from bare's on {', '.join(errors)}: not the same update")
    if fp8.get("failed"):
        return _fail(f"the fp8 rollout: {fp8['failed']}")
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


def _vllm_fp8(device: str, out: Path, env: dict, started: float) -> dict:
    """Step 4 in its own process (vLLM's engine and its GPU memory end with it); skipped, saying
    why, without a GPU or without vLLM."""
    if device != "cuda":
        return {"skipped": "no GPU (--device cpu)"}
    if not _importable("vllm"):
        return {"skipped": "vLLM is not installed in this Python (pip install 'streamrl[vllm]')"}
    left = BUDGET_S - (time.monotonic() - started)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--vllm-fp8-only", "--out", str(out)],
                          cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, timeout=max(120.0, left * 0.9))
    if proc.returncode:
        return {"failed": f"exit {proc.returncode} (its log above)"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _vllm_fp8_rollout(out: Path) -> dict:
    """Step 4's body (see the module's doc), through streamrl's own backend and config."""
    import asyncio

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    from streamrl.policy import byte_tokenizer
    from streamrl.rollout.backends import SamplingParams, make_backend
    from streamrl.rollout.config import RolloutConfig
    from streamrl.weights import save_policy

    tok = byte_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, torch_dtype="bfloat16")
    torch.manual_seed(0)
    first = Qwen2ForCausalLM(config).to(torch.bfloat16)
    v0 = save_policy(first, tok, out / "fp8-policy" / "v0")
    second = Qwen2ForCausalLM(config).to(torch.bfloat16)  # other random weights
    v1 = save_policy(second, tok, out / "fp8-policy" / "v1")
    cfg = RolloutConfig(backend="vllm", policy=str(v0), dtype="bfloat16", quantization="fp8").validate()
    cfg.vllm.gpu_memory_utilization = 0.3
    cfg.vllm.engine_kwargs = {"enforce_eager": True, "max_model_len": 512}
    prompts = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(8)]
    params = SamplingParams(max_new_tokens=32, temperature=0.0)

    async def go() -> tuple[list, list, list, float]:
        backend = make_backend(cfg)
        try:
            a = [s for [s] in await backend.generate(prompts, 1, params)]
            load_s = await backend.load_weights(str(v1), 1)
            b = [s for [s] in await backend.generate(prompts, 1, params)]
            await backend.load_weights(str(v0), 2)
            c = [s for [s] in await backend.generate(prompts, 1, params)]
            return a, b, c, load_s
        finally:
            await backend.close()

    a, b, c, load_s = asyncio.run(go())

    def logprob_gap(x: list, y: list) -> float:
        gaps = [abs(float(p) - float(q)) for s, t in zip(x, y) for p, q in zip(s.response_logprobs, t.response_logprobs)]
        return sum(gaps) / max(1, len(gaps))

    same_tokens = all(s.response_ids == t.response_ids for s, t in zip(a, c))
    reload_gap, other_gap = logprob_gap(a, c), logprob_gap(a, b)
    first = first.cuda().eval()  # the bf16 policy's own log-probs of the fp8 engine's tokens
    gaps = []
    with torch.no_grad():
        for s in a:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
            logp = torch.log_softmax(first(ids).logits[0, :-1].float(), -1)
            own = logp[len(s.prompt_ids) - 1:].gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
            gaps += (own.cpu() - torch.tensor(s.response_logprobs)).abs().tolist()
    result = {"quantization": "fp8", "load_s": round(load_s, 2), "tokens": sum(len(s.response_ids) for s in a),
              "reload_same_tokens": same_tokens, "reload_logprob_gap": round(reload_gap, 5),
              "other_version_logprob_gap": round(other_gap, 5),
              "fp8_vs_bf16_logprob_gap": round(sum(gaps) / max(1, len(gaps)), 5)}
    if not same_tokens or reload_gap > 0.05:
        result["failed"] = "the first version, loaded again, did not give back its tokens and log-probs"
    elif other_gap < 1e-3:
        result["failed"] = "the second version sampled as the first: its weights were not loaded"
    return result


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
