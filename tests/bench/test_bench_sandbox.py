"""``streamrl bench sandbox`` on a few executions: every variant ran the program right, and the
JSON line carries the side-by-side figures."""

from __future__ import annotations

from streamrl.cli import main
from tests.helpers import binary, last_json_line


def test_bench_sandbox_reports_each_variant_side_by_side(capsys):
    binary("bwrap")
    assert main(["bench", "sandbox", "--quick", "--executions", "6", "--concurrency", "2"]) == 0
    summary = last_json_line(capsys.readouterr().out)
    assert set(summary["executions_per_s"]) == {"bare", "isolated", "service"}
    assert all(v > 0 for v in summary["executions_per_s"].values())
    assert summary["isolated_over_bare"] > 0 and summary["service_over_bare"] > 0
    assert "namespaces" in summary["isolation"] and "isolation_overhead_ms" in summary
