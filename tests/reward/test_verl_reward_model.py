"""verl's reward model as verl users configure it (issue 63), in both schema generations
(``reward.reward_model.*`` and the legacy ``reward_model.*``):

- a discriminative model (a tiny Qwen2 sequence classifier built from a config, with a chat
  template) scores every record in the reward group on the real broker, each score the model's
  own forward pass over the chat template of [prompt, response], last token;
- a generative model: the custom reward function gets ``reward_router_address`` and calls the
  reward model's chat completions through a router over the model's own fleet. vLLM cannot run
  here, so the fleet's ``vllm`` is a real HTTP server speaking the OpenAI chat API (aiohttp),
  launched and health-checked by the reward member exactly as ``vllm serve`` would be;
- the replicas, flags and placement read from verl's keys."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from streamrl.errors import ConfigError
from streamrl.pipeline_config import load_config
from streamrl.policy import byte_tokenizer
from streamrl.reward.stage import RewardStage
from streamrl.servers.processes import server_argv
from streamrl.testing import score
from tests.helpers import Collector, dry_run, produce, trajectory

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> Path:
    """A sequence-classification reward model (one label) with its tokenizer, saved as a checkpoint."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    where = tmp_path_factory.mktemp("tiny_rm")
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(where)
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(where)
    return where


def forward_scores(model_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """The reward model's own forward pass, one record at a time (no padding): verl's DisRM
    input (the chat template over [user, assistant], no special tokens added) and score (the
    last token's logit)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1).eval()
    out = []
    for prompt, response in pairs:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out.append(float(model(torch.tensor([ids])).logits[0, -1]))
    return out


@pytest.mark.parametrize("keys", [["reward.reward_model.enable=true", "reward.reward_model.model_path={rm}"],
                                  ["reward_model.enable=true", "reward_model.model.path={rm}"]],
                         ids=["verl-0.9.1", "legacy"])
def test_a_discriminative_reward_model_scores_in_the_reward_group_on_the_broker(keys, tiny_rm, bus_config):
    cfg = load_config(None, [k.format(rm=tiny_rm) for k in keys]
                      + ["reward.reward_model.rollout.max_num_seqs=3" if keys[0].startswith("reward.")
                         else "reward_model.rollout.max_num_seqs=3"])
    spec = cfg.reward.scorers["reward_model"]
    assert spec.type == "model" and spec.data_sources == ["*"] and spec.model["max_batch_size"] == 3
    cfg.bus = bus_config
    cfg.reward.group = f"reward-{bus_config.topic_prefix}"
    pairs = [(f"What is {i} + {i}?", f"It is {2 * i}." if i % 3 else "I do not know, sorry.") for i in range(10)]
    # any data source: the model scores every record, the built-in rules' included (gsm8k)
    records = [trajectory(i, data_source=("gsm8k", "chat", "math")[i % 3], prompt=p, response=r, ground_truth="0")
               for i, (p, r) in enumerate(pairs)]
    stage = RewardStage(cfg)

    async def main():
        stop = asyncio.Event()
        run = asyncio.create_task(stage.run(stop))
        async with Collector(stage.bus) as out:
            await produce(stage.bus, records)
            await out.wait(lambda: len(out.rewarded) + len(out.dead) >= len(records), 120)
            stop.set()
            await run
        return out.rewarded, out.dead

    rewarded, dead = asyncio.run(main())
    assert dead == []
    by_id = {r.id: r for r in rewarded}
    got = [by_id[t.id].reward for t in records]
    assert got == pytest.approx(forward_scores(tiny_rm, pairs), abs=1e-4)
    assert len(set(round(g, 4) for g in got)) > 3  # the scores tell the texts apart
    assert {by_id[t.id].scorer["name"] for t in records} == {"reward_model"}


def test_the_reward_models_servers_replicas_and_flags_from_verls_keys(tmp_path):
    base = ["reward.reward_model.enable=true", "reward.reward_model.model_path=Skywork/RM-8B"]
    cfg = load_config(None, [*base, "reward.reward_model.rollout.name=vllm", "reward.reward_model.enable_resource_pool=true",
                             "reward.reward_model.n_gpus_per_node=4", "reward.reward_model.nnodes=2",
                             "reward.reward_model.rollout.tensor_model_parallel_size=2", "reward.num_workers=2",
                             "reward.reward_model.rollout.gpu_memory_utilization=0.7",
                             "reward.reward_model.rollout.max_model_len=8192", "reward.reward_model.rollout.max_num_seqs=64",
                             "reward.reward_model.rollout.enforce_eager=false",
                             "reward.reward_model.rollout.enable_prefix_caching=false",
                             "reward.reward_model.rollout.engine_kwargs={vllm: {swap_space: 4}}",
                             "reward.reward_model.rollout.temperature=0.6"])
    server, = cfg.reward.servers
    # 4 x 2 GPUs in the reward model's own pool, replicas of 2, over verl's 2 reward workers (the group's members)
    assert (server.name, server.backend, server.replicas, server.gpus_per_replica, server.task) == \
        ("reward_model", "vllm", 2, 2, "classify")
    assert cfg.run.reward_members == 2 and cfg.run.ray.resources["reward"] == {"num_gpus": 4.0}  # each member's share
    argv = server_argv(server, 8000)
    assert argv[1:] == ["serve", "Skywork/RM-8B", "--host", "127.0.0.1", "--port", "8000", "--runner", "pooling",
                        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.7", "--max-model-len", "8192",
                        "--max-num-seqs", "64", "--no-enable-prefix-caching", "--swap-space", "4"]
    model = cfg.reward.scorers["reward_model"].model
    assert model["server"] == "reward_model" and model["max_batch_size"] == 64 and model["max_length"] == 8192
    sglang = load_config(None, [*base, "reward_model.rollout.name=sglang", "reward_model.rollout.tensor_model_parallel_size=1",
                                "reward_model.rollout.gpu_memory_utilization=0.5", "reward_model.rollout.data_parallel_size=2"])
    server, = sglang.reward.servers
    assert server.replicas == 2 and server_argv(server, 9)[3:] == [
        "--model-path", "Skywork/RM-8B", "--is-embedding", "--host", "127.0.0.1", "--port", "9", "--tp-size", "1",
        "--mem-fraction-static", "0.5"]
    for bad, field in ((["reward.reward_model.enable=true"], "reward_model.model_path"),
                       ([*base, "reward.reward_model.rollout.name=trtllm"], "reward_model.rollout.name"),
                       ([*base, "reward.reward_model.rollout.name=vllm", "reward.reward_model.enable_resource_pool=true",
                         "reward.reward_model.n_gpus_per_node=1", "reward.reward_model.nnodes=1"], "n_gpus_per_node")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, bad)
    # the dry run reports each key; the sampling settings are not applicable, a quantization file refused
    code, out, err = dry_run([*base, "reward.reward_model.model_path=/models/rm", "reward.reward_model.rollout.top_p=0.5",
                              "reward.reward_model.rollout.quantization_config_file=q.json"], tmp_path)
    assert code == 2 and "reward.reward_model.rollout.quantization_config_file=q.json: refused" in err
    code, out, err = dry_run([*base, "reward.reward_model.model_path=/models/rm", "reward.reward_model.rollout.top_p=0.5"],
                             tmp_path)
    assert code == 0, err
    assert "reward.reward_model.model_path=/models/rm -> reward_model.model_path=/models/rm" in out
    assert "reward.reward_model.rollout.top_p=0.5 -> not applicable here: the reward model's sampling" in out


# A stand-in for `vllm serve MODEL ...` (vLLM cannot run here): a real aiohttp server speaking the
# OpenAI chat API, answering "Score: N" with N the length of the last message mod 10, and
# logging each request's port so the test sees which replica served it.
FAKE_VLLM = '''#!{python}
import json, sys
from aiohttp import web

args = sys.argv[1:]
assert args[0] == "serve" and "--runner" not in args, args
port = int(args[args.index("--port") + 1])

async def chat(request):
    body = await request.json()
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"port": port, "model": body.get("model")}}) + "\\n")
    n = len(body["messages"][-1]["content"]) % 10
    return web.json_response({{"id": "c", "object": "chat.completion", "model": body.get("model"),
                              "choices": [{{"index": 0, "finish_reason": "stop",
                                           "message": {{"role": "assistant", "content": f"Score: {{n}}"}}}}]}})

async def ok(request):
    return web.json_response({{"object": "list", "data": []}})

app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", ok)
app.router.add_get("/v1/models", ok)
web.run_app(app, host="127.0.0.1", port=port, print=None)
'''

# A GenRM reward function as verl's docs write one: async, it calls chat completions through
# reward_router_address and parses the judge's score.
GENRM_FUNCTION = '''
import re
import aiohttp

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_router_address=None,
                        reward_model_tokenizer=None, scale=1.0):
    body = {"model": "genrm", "messages": [{"role": "user", "content": solution_str}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{reward_router_address}/v1/chat/completions", json=body) as resp:
            answer = await resp.json()
    text = answer["choices"][0]["message"]["content"]
    return {"score": scale * int(re.search(r"Score: (\\d+)", text).group(1)) / 10, "judge": text,
            "rm_tokens": len(reward_model_tokenizer.encode(solution_str, add_special_tokens=False))}
'''


def test_a_generative_reward_model_is_called_through_the_router_over_its_own_fleet(tmp_path, monkeypatch):
    import json

    log = tmp_path / "requests.jsonl"
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text(FAKE_VLLM.format(python=sys.executable, log=str(log)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "genrm.py").write_text(textwrap.dedent(GENRM_FUNCTION))
    genrm = tmp_path / "genrm"  # the reward model's checkpoint: its tokenizer is what the function gets
    byte_tokenizer().save_pretrained(genrm)
    cfg = load_config(None, ["reward.reward_model.enable=true", f"reward.reward_model.model_path={genrm}",
                             "reward.reward_model.rollout.name=vllm", "reward.reward_model.enable_resource_pool=true",
                             "reward.reward_model.n_gpus_per_node=2", "reward.reward_model.nnodes=1",
                             "reward.reward_model.rollout.tensor_model_parallel_size=1", "reward.num_workers=1",
                             f"reward.custom_reward_function.path={tmp_path / 'genrm.py'}",
                             "reward.custom_reward_function.reward_kwargs.scale=2.0"])
    server, = cfg.reward.servers
    assert (server.task, server.replicas, cfg.reward.reward_router) == ("generate", 2, "reward_model")
    assert "reward_model" not in cfg.reward.scorers  # the function scores; the model serves it
    server.startup_timeout_s = 60.0
    responses = [f"answer number {'x' * i}" for i in range(12)]
    out = score([{"data_source": "anything", "response": r} for r in responses], reward=cfg.reward)
    assert [o.reward for o in out] == pytest.approx([2.0 * (len(r) % 10) / 10 for r in responses])
    assert all(o.reward_info["judge"].startswith("Score: ") for o in out)
    assert [o.reward_info["rm_tokens"] for o in out] == [len(r.encode()) for r in responses]  # the RM's tokenizer
    served = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(served) == len(responses) and len({s["port"] for s in served}) == 2  # both replicas, behind the router
