"""Metadata as the UI shows it: tables with a schema, numbers rounded and kept numbers."""

from __future__ import annotations

import dagster as dg

from assets._common import report_metadata, round_value, rounded, table
from eagle3_dagster.stages import StageReport


def test_rows_with_missing_values_become_a_table_with_typed_columns():
    value = table([{"method": "no_spec", "acceptance_length": None, "num_prompts": 4},
                   {"method": "eagle3", "acceptance_length": 2.318712, "num_prompts": 4}],
                  {"acceptance_length": "tokens per verify step"})
    assert [(c.name, c.type) for c in value.schema.columns] == [
        ("method", "string"), ("acceptance_length", "float"), ("num_prompts", "int")]
    assert [r.data for r in value.records] == [
        {"method": "no_spec", "acceptance_length": None, "num_prompts": 4},
        {"method": "eagle3", "acceptance_length": 2.319, "num_prompts": 4}]


def test_floats_are_rounded_to_four_significant_digits_and_stay_numbers():
    assert round_value(4.319930195808411) == 4.32 and round_value(12345.6789) == 12345.7
    typed = table([{"a": 1}])
    meta = report_metadata(StageReport(metadata={"final_loss": 4.319930195808411, "rows": [{"a": 1}],
                                                 "typed": typed}))
    assert meta["typed"] is typed
    assert meta["final_loss"] == dg.MetadataValue.float(4.32)
    assert isinstance(meta["rows"], dg.TableMetadataValue)
    assert rounded({"loss": dg.MetadataValue.float(0.123456789)})["loss"] == dg.MetadataValue.float(0.1235)
