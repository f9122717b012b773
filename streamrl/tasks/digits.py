"""``digits``: short digit-string puzzles generated from a seed, the embedded default's task.

A row asks one operation on two digits and knows its answer::

    {"question": "inc 48=", "answer": "59", "data_source": "digits", "extra_info": {...}}

Operations (``digits:OP``): ``inc`` (add one to each digit, 9 wraps to 0; the default), ``copy``,
``rev`` (reverse), ``sort`` (ascending). The dataset spec is ``digits[:OP][@SEED]``: the same spec
gives the same rows on any machine (``random.Random`` seeded by the spec, nothing else). The
scorer is ``streamrl.scorers.digits`` (exact, with partial credit per position).

The warm start (``warm_start``). The default policy is a byte-level model of ~0.1M parameters
from random weights: it writes random bytes and rarely stops, so every answer scores 0 and RL has
nothing to climb; and even a policy that answers digits and stops (tried: a supervised pass
on random digits) learns nothing by RL within minutes on two CPU cores, because to earn reward it
must first learn to *read* the digits of the prompt, which no single sampled answer rewards. So a
short supervised pass (80 steps of 64, seconds) teaches it to read: prompts of the ``copy``
operation answered by their copy and end-of-sequence. It is stopped early, while it copies about
four digits in ten (further, it copies so surely that RL rarely samples anything else and
learns slower, measured). It has never seen the task's own operation (``inc``): its reward
there starts at ~0.05, and what it learns beyond is RL's doing. Real runs start the same way:
from a model that can already read and write, which RL teaches a skill. (Noisy copies, to keep
its guesses spread, ``noise=0.5``, did not teach reading within 150 steps.)

Why two digits (``DIGITS``), and the learner's entropy bonus. What RL learns here is ten facts,
one output digit per input digit. With three digits the default run rose to 0.55-0.8 and stayed
(in-process on-policy runs, seeds 0-2: 0.38-0.69 over the last 10 of 80 versions): a sequence's
reward is shared by all its digits, so a wrong digit is reinforced whenever its neighbours were
right, and once a wrong mapping (2 -> 7, 7 -> 0 in the archive of one run) is nearly certain,
every sample of its group is wrong alike, the group's advantage is 0 and the right digit is
never sampled again. Two digits halve that shared credit, and ``learner.entropy_coeff`` (0.03 in
``local.yaml``) keeps every digit's guesses spread until the right one is found: in-process, 0.98
and 0.81 over the last 10 of 80 versions (seeds 0, 1), against 0.38-0.69 with neither.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

from streamrl.policy import load_policy
from streamrl.weights import save_policy

NAME = "digits"
DATA_SOURCE = "digits"
OPS: dict[str, Callable[[str], str]] = {
    "inc": lambda s: "".join(str((int(c) + 1) % 10) for c in s),
    "copy": lambda s: s,
    "rev": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
}
DEFAULT_OP = "inc"
WARM_OP = "copy"  # what the warm start teaches (reading the digits), never the task's own op
DIGITS = 2  # two digits: see "Why two digits" in the module doc
DEFAULT_ROWS = 2000


def parse(spec: str) -> tuple[str, int]:
    """``digits[:OP][@SEED]`` -> ``(op, seed)``; anything else raises ``ValueError``."""
    body, _, seed = spec.partition("@")
    name, _, op = body.partition(":")
    op = op or DEFAULT_OP
    if name != NAME or op not in OPS:
        raise ValueError(f"dataset {spec!r}: the generated task is {NAME}[:OP][@SEED], OP one of {', '.join(OPS)}")
    if seed and not seed.isdigit():
        raise ValueError(f"dataset {spec!r}: the seed after '@' is a non-negative integer")
    return op, int(seed or 0)


def question(op: str, digits: str) -> str:
    return f"{op} {digits}="


def _digits(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(DIGITS))


def generate(spec: str = NAME, limit: int = 0) -> list[dict[str, Any]]:
    """``limit`` rows (0: ``DEFAULT_ROWS``) of ``spec``: a pure function of its arguments."""
    op, seed = parse(spec)
    rng = random.Random(f"{NAME}:{op}:{seed}")
    rows = []
    for _ in range(limit or DEFAULT_ROWS):
        d = _digits(rng)
        rows.append({"question": question(op, d), "answer": OPS[op](d), "data_source": DATA_SOURCE,
                     "extra_info": {"op": op, "digits": d}})
    return rows


def warm_start(directory: str | Path, policy: str = "tiny", seed: int = 0, steps: int = 80,
               batch: int = 64, lr: float = 3e-3, noise: float = 0.0) -> Path:
    """``policy`` after the supervised reading pass of the module doc, written to ``directory``
    (Hugging Face layout, usable as ``learner.policy`` / ``rollout.policy``); deterministic by
    ``seed``. ``noise``: the share of target digits replaced by random ones (0: clean copies).
    A directory that already holds a policy is reused as it is."""
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    import torch


    model, tok = load_policy(policy, seed=seed)
    rng = random.Random(f"warm:{seed}")
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(batch):
            d = _digits(rng)
            target = "".join(c if rng.random() >= noise else rng.choice("0123456789") for c in OPS[WARM_OP](d))
            p = tok(question(WARM_OP, d), add_special_tokens=False)["input_ids"]
            r = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids.append(p + r)
            labels.append([-100] * len(p) + r)
        loss = model(input_ids=torch.tensor(ids), labels=torch.tensor(labels)).loss  # one length: no padding
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    directory.parent.mkdir(parents=True, exist_ok=True)
    return save_policy(model, tok, directory)
