"""Writes ``tests/learner/recipe_parity_data.py``: what verl-recipe's own GVPO loss
(``gvpo/gvpo_core_algos.py``: ``compute_policy_loss_gvpo``) returns, and its gradient, on
generated inputs, for ``tests/learner/test_recipe_parity.py`` to compare streamrl's ``gvpo`` loss
against (issue 66). Numbers are facts about the recipe; none of its code is in streamrl.

The inputs are not stored: each case is made again from its seed by ``case_inputs`` (the test
calls it too), and a digest of its tensors is stored to tell a changed generator from a changed
loss. Run it with verl-recipe's checkout (``fetch github:verl-project/verl-recipe``, its tree as
a folder) and verl's dependencies on the path; it spawns two gloo ranks for the cases whose
groups are split over the data-parallel ranks (the recipe gathers its micro-batch over them)::

    pip install --no-deps --target /tmp/verl-deps tensordict pyvers codetiming
    git --git-dir=<verl-recipe mirror> archive HEAD gvpo | tar x -C /tmp/verl-recipe
    PYTHONPATH=/tmp/verl-deps:/tmp/verl-recipe .venv/bin/python tests/learner/recipe_parity.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import torch

OUT = Path(__file__).parent / "recipe_parity_data.py"

#: the cases: seeds 0..N-1 on one rank, and M on two ranks (a group's members on both)
ONE_RANK, TWO_RANKS = 160, 60
#: log-ratio spreads (per token): near on-policy, typical, far off-policy, extreme
SPREADS = (1e-3, 0.3, 3.0, 12.0)
BETAS = (0.01, 0.1, 1.0)


def case_inputs(seed: int, world: int) -> dict:
    """Case ``seed``'s tensors (float64), the group ids of its rows (``uid``, as the recipe's
    ``uid_tensor``: the row's group as a float), and each rank's rows (contiguous, equal)."""
    g = torch.Generator().manual_seed(1000 * world + seed)
    n = int(torch.randint(2, 9, (1,), generator=g))  # the group size (rollout.n)
    groups = int(torch.randint(1, 5, (1,), generator=g))
    if world == 2 and (groups * n) % 2:
        groups += 1  # each rank holds as many rows (the recipe's all_gather)
    B, T = groups * n, int(torch.randint(1, 13, (1,), generator=g))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    holes = torch.rand(B, T, generator=g) < 0.15  # tokens the policy did not produce (tool output)
    holes[:, 0] = False  # (every row keeps a token: the recipe divides by each row's count)
    mask = mask * (~holes).double()
    spread = SPREADS[int(torch.randint(0, len(SPREADS), (1,), generator=g))]
    beta = BETAS[int(torch.randint(0, len(BETAS), (1,), generator=g))]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 10 - 1e-4
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread).clamp(max=-1e-6)
    scale = float(10 ** torch.empty(1, dtype=torch.float64).uniform_(-2, 1.5, generator=g))  # reward ranges
    rewards = torch.randn(B, generator=g, dtype=torch.float64) * scale
    if bool(torch.rand(1, generator=g) < 0.3):
        rewards = (rewards > 0).double()  # 0/1 rewards, with groups that agree
    uid = torch.arange(B, dtype=torch.float64) // n
    if bool(torch.rand(1, generator=g) < 0.5):  # GRPO's advantage without the std (the recipe's script)
        centred = rewards - rewards.view(groups, n).mean(-1).repeat_interleave(n)
        advantages = centred[:, None] * mask
    else:  # any per-token advantages: the recipe takes each sequence's mean
        advantages = torch.randn(B, T, generator=g, dtype=torch.float64) * scale * mask
    order = torch.randperm(B, generator=g) if world > 1 else torch.arange(B)  # groups split over the ranks
    return {"n": n, "beta": beta, "world": world, "mask": mask[order], "old": old[order], "logp": logp[order],
            "advantages": advantages[order], "uid": uid[order]}


def digest(case: dict) -> str:
    h = hashlib.sha256()
    for key in ("mask", "old", "logp", "advantages", "uid"):
        h.update(case[key].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def all_seeds() -> list[tuple[int, int]]:
    return [(s, 1) for s in range(ONE_RANK)] + [(s, 2) for s in range(TWO_RANKS)]


def _recipe_rank(rank: int, world: int, port: int, seeds: list[int], out: str) -> None:
    """One rank of the recipe's loss: its rows of each case, the whole world's groups gathered."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from gvpo.gvpo_core_algos import compute_policy_loss_gvpo

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))  # (verl's FSDP workers' mesh)
    results = {}
    for seed in seeds:
        case = case_inputs(seed, world)
        rows = slice(rank * len(case["uid"]) // world, (rank + 1) * len(case["uid"]) // world)
        logp = case["logp"][rows].clone().requires_grad_(True)
        loss = compute_policy_loss_gvpo(old_log_prob=case["old"][rows], log_prob=logp,
                                        advantages=case["advantages"][rows], response_mask=case["mask"][rows],
                                        beta=case["beta"], uid=case["uid"][rows], device_mesh=mesh, n=case["n"])
        loss.backward()
        results[seed] = {"loss": loss.item(), "grad": logp.grad.tolist()}
    Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def _run(world: int, seeds: list[int], tmp: Path) -> list[dict]:
    import torch.multiprocessing as mp

    from streamrl.net import free_port

    mp.spawn(_spawned, args=(world, free_port(), seeds, str(tmp)), nprocs=world, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _spawned(rank: int, world: int, port: int, seeds: list[int], tmp: str) -> None:
    torch.set_num_threads(1)
    _recipe_rank(rank, world, port, seeds, str(Path(tmp) / f"rank{rank}.json"))


def main() -> None:
    import tempfile

    import gvpo.gvpo_core_algos as recipe

    source = Path(recipe.__file__).read_bytes()
    head = subprocess.run(["git", "-C", str(Path(recipe.__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    out: dict = {"recipe": "verl-project/verl-recipe gvpo/gvpo_core_algos.py compute_policy_loss_gvpo",
                 "recipe_commit": head or "48ea0a7", "source_sha256": hashlib.sha256(source).hexdigest(),
                 "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for world, count in ((1, ONE_RANK), (2, TWO_RANKS)):
            seeds = list(range(count))
            ranks = _run(world, seeds, Path(tmp))
            for seed in seeds:
                case = case_inputs(seed, world)
                out["cases"].append({"seed": seed, "world": world, "digest": digest(case),
                                     "ranks": [{"loss": r[str(seed)]["loss"], "grad": r[str(seed)]["grad"]}
                                               for r in ranks]})
    OUT.write_text('"""What verl-recipe\'s GVPO loss returned, and its gradient, on the inputs\n'
                   "tests/learner/recipe_parity.py makes from each case's seed (that script wrote this;\n"
                   'tests/learner/test_recipe_parity.py reads it)."""\n\n'
                   f"DATA = {json.dumps(out, separators=(',', ':'))!r}\n")
    print(f"wrote {OUT}: {len(out['cases'])} cases")


if __name__ == "__main__":
    main()
