"""Metadata as the UI shows it: tables with a schema, numbers rounded and kept numbers."""

from __future__ import annotations

import dagster as dg

from assets._common import report_metadata, round_value, rounded, table
from eagle3_dagster.stages import StageReport


def test_rows_with_missing_values_become_a_table_with_typed_columns():
    value = table(
        [
            {"method": "no_spec", "acceptance_length": None, "num_prompts": 4},
            {"method": "eagle3", "acceptance_length": 2.318712, "num_prompts": 4},
        ],
        {"acceptance_length": "tokens per verify step"},
    )
    assert [(c.name, c.type) for c in value.schema.columns] == [
        ("method", "string"),
        ("acceptance_length", "float"),
        ("num_prompts", "int"),
    ]
    assert [r.data for r in value.records] == [
        {"method": "no_spec", "acceptance_length": None, "num_prompts": 4},
        {"method": "eagle3", "acceptance_length": 2.319, "num_prompts": 4},
    ]


def test_floats_are_rounded_to_four_significant_digits_and_stay_numbers():
    assert round_value(4.319930195808411) == 4.32 and round_value(12345.6789) == 12345.7
    typed = table([{"a": 1}])
    meta = report_metadata(StageReport(metadata={"final_loss": 4.319930195808411, "rows": [{"a": 1}], "typed": typed}))
    assert meta["typed"] is typed
    assert meta["final_loss"] == dg.MetadataValue.float(4.32)
    assert isinstance(meta["rows"], dg.TableMetadataValue)
    assert rounded({"loss": dg.MetadataValue.float(0.123456789)})["loss"] == dg.MetadataValue.float(0.1235)


def test_a_series_is_an_inline_sparkline_from_its_first_to_its_last_value():
    """Dagster's asset page renders markdown inline only below 1,000 characters; a PNG never is."""
    loss = [5.0 - 4.0 * i / 999 for i in range(1000)]  # falls from 5 to 1 over 1,000 steps
    meta = report_metadata(StageReport(series={"loss_by_step": (loss, "training step"), "empty": ([], "x")}))
    text = meta["loss_by_step"].value
    assert isinstance(meta["loss_by_step"], dg.MarkdownMetadataValue) and len(text) < 1000
    assert text.startswith("`5.0` █") and "▁ `1.0` — 1,000 points by training step, min 1.0, max 5.0" in text
    bars = text.split(" ")[1]
    assert len(bars) == 48 and list(bars) == sorted(bars, reverse=True)  # a falling curve draws falling bars
    assert "empty" not in meta


def test_every_materialization_carries_a_legend_naming_each_key_and_the_ones_not_described():
    """Dagster 1.13 has no per-key metadata description: the legend is one markdown entry listing them."""
    from assets._common import materialize_result

    report = StageReport(metadata={"forced": True, "resumed_shards": 0, "something_new": 1}, data_version="v")

    @dg.asset(name="hidden_states", metadata={"settings": dg.MetadataValue.json({"hidden.dtype": "bfloat16"})})
    def hidden_states(context):  # from __future__ annotations: Dagster cannot read a string annotation
        return materialize_result(context, report)

    [event] = dg.materialize([hidden_states]).asset_materializations_for_node("hidden_states")
    meta = event.metadata
    assert meta["settings"].data == {"hidden.dtype": "bfloat16"}  # the settings its definition was built with
    text = meta["metadata_legend"].value
    assert "| `forced` | whether the run config set force" in text
    assert "| `settings` | the profile settings" in text
    assert "| `something_new` | (not described yet) |" in text and "`metadata_legend`" not in text


def test_the_trained_drafters_figures_are_described_with_what_they_were_measured_on():
    from assets.metadata_legend import describe, undescribed
    from eagle3_dagster.train.outputs import summary_metadata

    metrics = {
        "steps": 3,
        "tokens_per_s": 10.0,
        "curves": {"loss": [2.0, 1.5]},
        "initial_eval": {"acc_0": 0.1},
        "final_eval": {
            "scope": "heldout",
            "loss": 1.2,
            "sim_accept_length": 1.7,
            "acc_0": 0.5,
            "acc_1": 0.3,
            "num_samples": 4,
            "num_scored_tokens": 40,
        },
    }
    keys = summary_metadata(metrics)
    assert not undescribed("drafter_checkpoint", keys)
    assert "held-out samples never trained on" in describe("drafter_checkpoint", "heldout_acc_1")
    assert "draft position 1" in describe("drafter_checkpoint", "heldout_acc_1")
    assert "training batch" in describe("drafter_checkpoint", "last_step_train_loss")


def test_the_data_assets_describe_every_key_their_stages_emit():
    from assets.metadata_legend import undescribed
    from eagle3_dagster.data.merge import MergeStats
    from eagle3_dagster.data.tokenize import TokenizeStats
    from eagle3_dagster.generate.regenerate import RegenerationStats

    # the stats' own keys and those eagle3_dagster/stages/data.py adds beside them
    emitted = {
        "raw_responses": [
            *RegenerationStats(dataset="d").as_dict(),
            "path",
            "source",
            "num_source_lines_quarantined",
            "source_quarantine_path",
            "num_conversations_quarantined_chat_template",
            "chat_template_quarantine_path",
            "regenerated",
            "sha256",
            "bytes",
            "settings",
        ],
        "tokenized_dataset": [*TokenizeStats(dataset="d").as_dict(), "path", "quarantine_path", "source"],
        "merged_train": [
            *MergeStats().as_dict(),
            "path",
            "sha256",
            "num_shards",
            "sequence_lengths",
            "records_by_length",
        ],
        "vocab_mapping": ["note"],
        # the headline keys eagle3_dagster/stages/bench.py and bench/report.py add (test_ui checks every real key)
        "benchmark_report": ["untrained_acceptance_length", "ngram_acceptance_length", "speedup_min", "speedup_max"],
    }
    assert {asset: undescribed(asset, keys) for asset, keys in emitted.items()} == {a: [] for a in emitted}
