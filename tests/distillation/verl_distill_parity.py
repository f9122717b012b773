"""Writes ``tests/distillation/verl_distill_parity_data.py``: what verl's own distillation functions return
on fixed tensors, for ``tests/distillation/test_distillation_losses.py`` to compare streamrl's against (issue
51). Numbers are facts about verl; none of its code is in streamrl.

verl's functions called: ``verl.trainer.distillation.losses.distillation_loss`` (the per-token
loss by ``loss_mode``, ``loss_max_clamp``, then the direct or the policy-gradient aggregation),
fed for ``forward_kl_topk`` by ``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk``
(the student's logits against the teacher's top-k), on verl's padding-free layout; the values
and the gradients with respect to the student's logits. Run it where verl 0.9.1 imports::

    pip install --no-deps --target /tmp/verl-deps tensordict pyvers codetiming
    PYTHONPATH=/tmp/verl-deps .venv/bin/python tests/distillation/verl_distill_parity.py
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import torch

OUT = Path(__file__).parent / "verl_distill_parity_data.py"
B, R, V, K = 3, 5, 11, 4
LENGTHS = [5, 3, 4]
MODES = ["forward_kl_topk", "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
#: (loss_max_clamp, log_prob_min_clamp) settings; each case takes one in turn
CLAMPS = [(None, None), (0.3, -2.0), (10.0, -10.0)]


def inputs(seed: int = 51) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, R, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    mask[0, 2] = 0.0  # a token the policy did not produce, inside a response
    student_logits = torch.randn(B, R, V, generator=g, dtype=torch.float64) * 1.5
    teacher_logits = torch.randn(B, R, V, generator=g, dtype=torch.float64) * 2.0
    sampled = torch.randint(0, V, (B, R), generator=g)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    top = torch.topk(teacher_lp, K, -1)
    student_lp = torch.log_softmax(student_logits, -1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    old = student_lp + torch.randn(B, R, generator=g, dtype=torch.float64) * 0.3
    return {"mask": mask.tolist(), "student_logits": student_logits.tolist(), "sampled": sampled.tolist(),
            "teacher_topk_logprobs": top.values.tolist(), "teacher_topk_ids": top.indices.tolist(),
            "teacher_logprobs": teacher_lp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1).tolist(),
            "old_logprobs": old.tolist()}


def flat(padded: torch.Tensor) -> torch.Tensor:
    """verl's padding-free layout of ``[B, R, ...]``: per sequence its response's rows, then one
    row for the prompt token (a 1-token prompt), which ``no_padding_2_padding`` drops."""
    rows = []
    for i, n in enumerate(LENGTHS):
        rows += [padded[i, :n], torch.zeros_like(padded[i, :1])]
    return torch.cat(rows)


def compute() -> dict:
    """verl's numbers on ``inputs()``, from the verl installed here (it must import)."""
    import verl
    from tensordict import TensorDict
    from verl.trainer.distillation import losses as vl
    from verl.trainer.distillation.fsdp import losses as fsdp_losses
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    case = inputs()
    sources = b"".join(Path(inspect.getfile(m)).read_bytes() for m in (vl, fsdp_losses))
    out: dict = {"verl": verl.__version__, "losses_sha256": hashlib.sha256(sources).hexdigest(),
                 "shape": [B, R, V, K], "lengths": LENGTHS, "inputs": case, "results": {}}
    t = {k: torch.tensor(v) for k, v in case.items()}
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    n = 0
    for mode in MODES:
        for use_pg in (False, True):
            if mode == "k1" and not use_pg:
                continue  # verl refuses it (the gradient would not depend on the teacher); "kl", its alias, it accepts
            for agg in AGG_MODES:
                loss_max, lp_min = CLAMPS[n % len(CLAMPS)]
                n += 1
                logits = t["student_logits"].clone().requires_grad_(True)
                logp_all = torch.log_softmax(logits, -1)
                student_lp = logp_all.gather(-1, t["sampled"].unsqueeze(-1)).squeeze(-1)
                lcfg = DistillationLossConfig(loss_mode=mode, topk=K, use_task_rewards=False,
                                              loss_max_clamp=loss_max, log_prob_min_clamp=lp_min,
                                              use_policy_gradient=use_pg)
                dcfg = DistillationConfig(enabled=False, distillation_loss=lcfg)
                model_output = {"log_probs": flat(student_lp)}
                data = TensorDict({
                    "prompts": torch.ones(B, 1, dtype=torch.long),
                    "responses": torch.ones(B, R, dtype=torch.long),
                    "attention_mask": torch.cat([torch.ones(B, 1),
                                                (torch.arange(R)[None] < torch.tensor(LENGTHS)[:, None]).double()], 1).long(),
                    "response_mask": t["mask"],
                    "old_log_probs": t["old_logprobs"],
                    "teacher_logprobs": flat(t["teacher_logprobs"]).unsqueeze(-1),
                    "dp_size": torch.tensor(1), "batch_num_tokens": t["mask"].sum(),
                    "global_batch_size": torch.tensor(float(B)),
                }, batch_size=[])
                if mode == "forward_kl_topk":
                    nest = lambda x: torch.nested.nested_tensor(  # noqa: E731
                        [torch.cat([x[i, :m], torch.zeros_like(x[i, :1])]) for i, m in enumerate(LENGTHS)],
                        layout=torch.jagged)
                    topk = fsdp_losses.compute_forward_kl_topk(
                        student_logits=flat(logits).unsqueeze(0), teacher_topk_log_probs=nest(t["teacher_topk_logprobs"]),
                        teacher_topk_ids=nest(t["teacher_topk_ids"]), config=dcfg, data_format="thd")
                    model_output.update({k: v.squeeze(0) for k, v in topk.items()})
                actor = SimpleNamespace(loss_agg_mode=agg, global_batch_info={}, loss_scale_factor=None)
                loss, metrics = vl.distillation_loss(actor, dcfg, model_output, data)
                loss.backward()
                out["results"][f"{mode}|pg={int(use_pg)}|{agg}"] = {
                    "mode": mode, "use_policy_gradient": use_pg, "agg": agg, "loss_max_clamp": loss_max,
                    "log_prob_min_clamp": lp_min, "loss": float(loss.detach()), "grad": logits.grad.tolist()}
    return out


def main() -> None:
    out = compute()
    OUT.write_text('"""What verl ' + out["verl"] + "'s own distillation functions returned\n"
                   "(tests/distillation/verl_distill_parity.py wrote this; "
                   'tests/distillation/test_distillation_losses.py reads it)."""\n\nDATA = ' + repr(json.dumps(out)) + "\n")
    print(f"wrote {OUT}: {len(out['results'])} cases")


if __name__ == "__main__":
    main()
