"""The GRPO update as the shortest plain PyTorch / transformers loop: what the hardware does
with no streamrl around it (no Kafka, no assembler, no checkpoint, no metrics, no entropy), the
yardstick of ``streamrl bench learner``.

It trains the same micro-batches as the learner (``microbatch.split`` on the same lengths), padded
or packed, with the same loss (PPO-clip with verl's dual clip on GRPO advantages, token-mean over
the mini-batch), so its loss must equal the learner's: the bench reports the difference to show
the two did the same work. It is written for the bench, not reused by the learner.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from streamrl.learner import microbatch


class BareGRPO:
    """A model, AdamW, and ``step(samples) -> (seconds, loss)``."""

    def __init__(self, model: Any, device: str, *, lr: float, weight_decay: float, packed: bool,
                 max_tokens: int, micro_batch_size: int, clip: float = 0.2, clip_c: float = 3.0,
                 grad_clip: float = 1.0):
        self.model, self.device, self.packed = model.train(), torch.device(device), packed
        self.max_tokens, self.micro_batch_size = max_tokens, micro_batch_size
        self.clip, self.clip_c, self.grad_clip = clip, clip_c, grad_clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def step(self, samples: Sequence[Any]) -> tuple[float, float]:
        started = time.perf_counter()
        samples = sorted(samples, key=lambda s: s.id)
        adv = _grpo_advantages(samples)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        n_tokens = float(sum(len(s.response_ids) for s in samples))
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in microbatch.split(lengths, self.max_tokens, self.micro_batch_size, packed=self.packed):
            seqs = [samples[i] for i in mb.indices]
            loss = sum(self._loss(s, lp, float(adv[i])) for i, s, lp in
                       zip(mb.indices, seqs, self._logprobs(seqs))) / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, total

    def _logprobs(self, seqs: Sequence[Any]) -> list[torch.Tensor]:
        """Each sequence's response-token log-probs, from one forward pass."""
        ids = [torch.as_tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long) for s in seqs]
        if self.packed:
            lengths = [len(x) for x in ids]
            cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)
            pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(self.device)
            logits = self.model(input_ids=torch.cat(ids).unsqueeze(0).to(self.device), position_ids=pos,
                                attention_mask={"full_attention": None}, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                max_length_q=max(lengths), max_length_k=max(lengths)).logits[0]
            starts = [int(c) for c in cu[:-1]]
            rows = [logits[a:a + len(x)] for a, x in zip(starts, ids)]
        else:
            batch = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True).to(self.device)
            mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in ids], batch_first=True)
            rows = list(self.model(input_ids=batch, attention_mask=mask.to(self.device)).logits)
        out = []
        for s, row in zip(seqs, rows):
            p, r = len(s.prompt_ids), len(s.response_ids)
            target = torch.as_tensor(s.response_ids, dtype=torch.long, device=self.device)
            out.append(torch.log_softmax(row[p - 1:p - 1 + r].float(), -1).gather(-1, target[:, None])[:, 0])
        return out

    def _loss(self, s: Any, logp: torch.Tensor, adv: float) -> torch.Tensor:
        """Summed per-token PPO-clip loss (dual clip for negative advantages)."""
        old = torch.as_tensor(s.behaviour_logprobs, dtype=torch.float32, device=self.device)
        ratio = torch.exp((logp - old).clamp(-20, 20))
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - self.clip, 1 + self.clip))
        if adv < 0 and self.clip_c:
            loss = torch.minimum(loss, torch.full_like(loss, -adv * self.clip_c))
        return loss.sum()


def _grpo_advantages(samples: Sequence[Any]) -> list[float]:
    """(r - group mean) / (group std + 1e-6), the unbiased std; a group of one keeps its reward."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append(i)
    out = [0.0] * len(samples)
    for members in groups.values():
        r = torch.tensor([samples[i].reward for i in members], dtype=torch.float32)
        mean, std = (r.mean(), r.std()) if len(members) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        for i, v in zip(members, ((r - mean) / (std + 1e-6)).tolist()):
            out[i] = v
    return out
