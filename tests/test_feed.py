"""The prompt feed: GSM8K rows to prompts (verl's template and ground truth), stable group ids,
new ids per epoch, parquet like JSONL, bad rows refused before anything is published."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest

from streamrl.config import ConfigError
from streamrl.datasets import packaged_path
from streamrl.records import Prompt
from streamrl.rollout.config import FeedConfig
from streamrl.rollout.feed import FeedError, build_prompts, gsm8k_ground_truth, publish_feed
from tests.helpers import read_topic

GSM8K = "gsm8k:test"  # the packaged copy, by name (streamrl.datasets)


def first_rows(n: int) -> list[dict]:
    with gzip.open(packaged_path(GSM8K), "rt") as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_gsm8k_prompt_and_ground_truth_follow_verl():
    cfg = FeedConfig(dataset=GSM8K, limit=3, shuffle=False, group_size=5)
    prompts = list(build_prompts(cfg))
    rows = first_rows(3)
    assert len(prompts) == 3
    p = prompts[0]
    assert p.prompt == [{"role": "user", "content": rows[0]["question"] + " Let's think step by step "
                         "and output the final answer after \"####\"."}]
    assert p.ground_truth == "18"  # "... #### 18" (Janet's ducks)
    assert p.group_size == 5 and p.data_source == "gsm8k" and p.epoch == 0
    assert p.extra_info["index"] == 0 and p.extra_info["answer"] == rows[0]["answer"]
    for p, row in zip(prompts, rows):
        assert p.ground_truth == row["answer"].split("#### ")[1].replace(",", "")
    assert gsm8k_ground_truth("so 1,234 in all\n#### 1,234") == "1234"
    assert gsm8k_ground_truth("#### -3.5") == "-3.5"


def test_group_ids_are_stable_and_new_per_epoch():
    cfg = FeedConfig(dataset=GSM8K, limit=20, epochs=2, shuffle=True, seed=7)
    a, b = list(build_prompts(cfg)), list(build_prompts(cfg))
    assert [p.group_id for p in a] == [p.group_id for p in b]  # same feed, same ids
    assert len({p.group_id for p in a}) == 40  # 20 rows x 2 epochs, all distinct
    by_epoch = {e: {p.extra_info["index"]: p.group_id for p in a if p.epoch == e} for e in (0, 1)}
    assert set(by_epoch[0]) == set(by_epoch[1]) == set(range(20))
    assert not set(by_epoch[0].values()) & set(by_epoch[1].values())
    # the order is shuffled per epoch, the ids do not depend on it
    order0 = [p.extra_info["index"] for p in a if p.epoch == 0]
    assert order0 != sorted(order0)
    unshuffled = {p.extra_info["index"]: p.group_id for p in build_prompts(
        FeedConfig(dataset=GSM8K, limit=20, shuffle=False))}
    assert unshuffled == by_epoch[0]
    # continuing a feed at epoch 1 gives epoch 1's ids
    cont = {p.extra_info["index"]: p.group_id for p in build_prompts(
        FeedConfig(dataset=GSM8K, limit=20, start_epoch=1))}
    assert cont == by_epoch[1]


def test_parquet_reads_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(first_rows(4)), path)
    from_parquet = list(build_prompts(FeedConfig(dataset=str(path), shuffle=False)))
    from_jsonl = list(build_prompts(FeedConfig(dataset=GSM8K, limit=4, shuffle=False)))
    assert [(p.group_id, p.prompt, p.ground_truth) for p in from_parquet] == \
           [(p.group_id, p.prompt, p.ground_truth) for p in from_jsonl]
    # verl's own preprocessed layout: prompt messages and reward_model.ground_truth
    verl_rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
                  "reward_model": {"style": "rule", "ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(verl_rows), tmp_path / "verl.parquet")
    (p,) = build_prompts(FeedConfig(dataset=str(tmp_path / "verl.parquet"), data_source="",
                                    prompt_template="", ground_truth="verl"))
    assert p.data_source == "openai/gsm8k" and p.ground_truth == "2"
    assert p.prompt == [{"role": "user", "content": "1+1?"}]


def test_bad_rows_and_config_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(FeedError, match="row 1.*####"):
        list(build_prompts(FeedConfig(dataset=str(bad))))
    bad.write_text(json.dumps({"answer": "#### 1"}) + "\n")
    with pytest.raises(FeedError, match="no field 'question'"):
        list(build_prompts(FeedConfig(dataset=str(bad))))
    bad.write_text("{not json\n")
    with pytest.raises(FeedError, match="bad.jsonl:1"):
        list(build_prompts(FeedConfig(dataset=str(bad))))
    with pytest.raises(ConfigError, match="feed.dataset"):
        list(build_prompts(FeedConfig(dataset=str(tmp_path / "missing.jsonl"))))
    with pytest.raises(ConfigError, match="feed.ground_truth"):
        list(build_prompts(FeedConfig(dataset=GSM8K, ground_truth="magic")))


def test_publish_feed_to_the_broker(bus):
    cfg = FeedConfig(dataset=GSM8K, limit=5, epochs=2, group_size=3)
    assert asyncio.run(publish_feed(bus, cfg)) == 10
    messages = asyncio.run(read_topic(bus, "prompts", 10, timeout_s=20))
    prompts = [Prompt.decode(m.value) for m in messages]
    assert sorted(p.group_id for p in prompts) == sorted(p.group_id for p in build_prompts(cfg))
    assert all(m.key == p.group_id.encode() for m, p in zip(messages, prompts))
    assert {p.epoch for p in prompts} == {0, 1} and all(p.group_size == 3 for p in prompts)


def test_example_config_loads():
    from streamrl.config import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "rollout.example.yaml")
    cfg.rollout.validate()
    assert cfg.feed.prompt_template == FeedConfig().prompt_template
    assert cfg.feed.group_size == 4 and cfg.rollout.backend == "transformers"
