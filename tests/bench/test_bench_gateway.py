"""``streamrl bench gateway`` end to end, small: its three variants run and the JSON line
carries the contract's keys (its figures: BENCHMARKS.md, the gateway section)."""

from __future__ import annotations

from streamrl.cli import main
from tests.helpers import last_json_line


def test_bench_gateway_reports_calls_per_second_and_added_latency(capsys, bootstrap, tmp_path):
    assert main(["bench", "gateway", "--quick", "--episodes", "3", "--turns", "2", "--bootstrap-servers", bootstrap,
                 "--out", str(tmp_path)]) == 0
    s = last_json_line(capsys.readouterr().out)
    assert s["episodes"] == 3 and s["turns"] == 2 and s["rounds"] == 1
    for key in ("direct_calls_per_s", "fleet_client_calls_per_s", "gateway_calls_per_s", "direct_p50_ms",
                "gateway_p50_ms", "end_episode_p50_ms", "ratio_gateway_to_direct_calls_per_s"):
        assert s[key] > 0, key
    assert (tmp_path / "gateway.json").exists()
