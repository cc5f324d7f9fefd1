"""benchmark_report's `results` table names each row's temperature, so a sampled row does not read as a
duplicate of the greedy row of the same set, method and configuration."""

from __future__ import annotations

import json

from assets.benchmark_report import RESULT_COLUMNS, results_metadata


def test_the_results_table_has_a_temperature_column_greedy_rows_at_zero(tmp_path) -> None:
    row = {"set": "heldout_sharegpt", "method": "eagle3", "spec": "3,1,4", "acceptance_length": 2.5}
    rows = [row, row | {"temperature": 0.8, "acceptance_length": 1.2}]  # a greedy row may carry no temperature
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": rows}))

    table = results_metadata(path)["results"]
    assert [c.name for c in table.schema.columns][:4] == ["set", "method", "spec", "temperature"]
    assert [r.data["temperature"] for r in table.records] == [0.0, 0.8]
    assert "temperature" in RESULT_COLUMNS and "greedy" in RESULT_COLUMNS["temperature"]
