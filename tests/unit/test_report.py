"""The benchmark report: tables per set, plots, raw JSON and the comparison with the previous run."""

from __future__ import annotations

import base64
import copy

import orjson

from eagle3_dagster.bench.report import (
    LengthBands,
    attach_speedups,
    band_entry,
    compare_results,
    headline,
    make_row,
    png_data_uri,
    render_report,
    results_document,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(set_name, method, spec, tokens_per_s, verify_tokens=0, verify_ct=0, accepted=()):
    return make_row(
        set_name,
        method,
        spec,
        num_prompts=4,
        prompt_tokens=100,
        completion_tokens=int(tokens_per_s * 2),
        wall_s=2.0,
        verify_ct=verify_ct,
        verify_tokens=verify_tokens,
        accepted_by_position=accepted,
    )


def _results(eagle_tokens: int = 300) -> dict:
    rows = []
    for s in ("heldout_sharegpt", "gsm8k"):
        rows += [
            _row(s, "no_spec", None, 50.0),
            _row(s, "eagle3", "3,1,4", 110.0, verify_tokens=eagle_tokens, verify_ct=100, accepted=(90, 70, 40)),
            _row(s, "eagle3_untrained", "3,1,4", 45.0, verify_tokens=102, verify_ct=100, accepted=(2, 0, 0)),
            _row(s, "ngram", "3,1,4", 60.0, verify_tokens=140, verify_ct=100, accepted=(30, 8, 2)),
        ]
    sets = {
        "heldout_sharegpt": {"num_prompts": 4, "source": "sharegpt heldout 5%"},
        "gsm8k": {"num_prompts": 4, "source": "/data/gsm8k.jsonl"},
    }
    return results_document(attach_speedups(rows), "inprocess", sets)


def test_rows_count_acceptance_like_sglang_and_speedup_over_no_speculation():
    rows = _results()["rows"]
    eagle = next(r for r in rows if r["method"] == "eagle3")
    assert eagle["acceptance_length"] == 3.0
    assert eagle["accept_rate_by_position"] == [0.9, 0.7, 0.4]
    assert eagle["speedup"] == 110.0 / 50.0
    base = next(r for r in rows if r["method"] == "no_spec")
    assert base["speedup"] == 1.0 and base["acceptance_length"] is None


def test_report_without_previous_results_has_tables_plots_and_says_first_run():
    results = _results()
    md, raw, pngs = render_report(results, None)
    assert "## heldout_sharegpt" in md and "## gsm8k" in md
    assert "| eagle3 | 3,1,4 | 3.000 | 2.20× |" in md
    assert "| ngram | 3,1,4 | 1.400 |" in md and "| eagle3_untrained | 3,1,4 | 1.020 |" in md
    assert "No previous results" in md
    assert set(pngs) == {"acceptance_by_position.png", "acceptance_by_set.png"}
    assert all(p.startswith(PNG_MAGIC) for p in pngs.values())
    assert png_data_uri(pngs["acceptance_by_set.png"]) in md
    # the raw JSON is the results as measured: serializable, and not altered by rendering (compared with a
    # document built afresh, not with the object handed in)
    assert orjson.loads(orjson.dumps(raw)) == _results()


def test_report_with_previous_results_says_what_got_better_or_worse_and_by_how_much():
    previous = _results(eagle_tokens=250)
    current = _results(eagle_tokens=300)
    md, _, _ = render_report(current, previous)
    assert "| heldout_sharegpt | eagle3 | 3,1,4 | acceptance_length | 2.500 | 3.000 | +0.500 (+20.0%) | better |" in md
    worse = copy.deepcopy(previous)
    comparison = compare_results(worse, current)
    eagle = [c for c in comparison if c["method"] == "eagle3" and c["metric"] == "acceptance_length"]
    assert {c["verdict"] for c in eagle} == {"worse"}
    assert eagle[0]["relative"] == -50 / 300
    unchanged = [c for c in comparison if c["method"] == "ngram"]
    assert {c["verdict"] for c in unchanged} == {"same"}


def test_comparison_marks_new_configurations():
    previous = _results()
    previous["rows"] = [r for r in previous["rows"] if r["method"] != "ngram"]
    comparison = compare_results(_results(), previous)
    assert {c["verdict"] for c in comparison if c["method"] == "ngram"} == {"new"}


def test_png_data_uri_round_trips():
    uri = png_data_uri(PNG_MAGIC + b"rest")
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.split(",", 1)[1]) == PNG_MAGIC + b"rest"


def _timed_row(method, spec, walls, bands=None, draft_s_per_token=None):
    row = make_row(
        "heldout_sharegpt",
        method,
        spec,
        num_prompts=2,
        prompt_tokens=100,
        completion_tokens=100,
        wall_s=sorted(walls)[len(walls) // 2],
        verify_ct=40 if spec else 0,
        verify_tokens=100 if spec else 0,
        wall_s_rounds=walls,
    )
    if bands is not None:
        row["bands"] = bands
    if draft_s_per_token is not None:
        row["draft_s_per_token"] = draft_s_per_token
    return row


def test_speedup_is_the_median_of_per_round_ratios_with_its_spread():
    # no_spec 100, 50, 100 tok/s; eagle3 200, 100, 150: per round 2.0, 2.0, 1.5 (the ratio of medians would be 1.5)
    rows = attach_speedups(
        [_timed_row("no_spec", None, [1.0, 2.0, 1.0]), _timed_row("eagle3", "3,1,4", [0.5, 1.0, 1 / 1.5])]
    )
    eagle = rows[1]
    assert eagle["speedup_rounds"] == [2.0, 2.0, 1.5]
    assert (eagle["speedup"], eagle["speedup_min"], eagle["speedup_max"]) == (2.0, 1.5, 2.0)
    assert (eagle["tokens_per_s"], eagle["tokens_per_s_min"], eagle["tokens_per_s_max"]) == (150.0, 100.0, 200.0)
    # the two medians a reader sees side by side give another ratio: it is carried too, named for what it is
    assert eagle["speedup_of_medians"] == 150.0 / 100.0 and rows[0]["speedup_of_medians"] == 1.0


def _banded_results() -> dict:
    bands = LengthBands.for_training(512, 2048)
    assert bands.labels == ["1–512", "513–2048", "> 2048"]

    def entries(short, long):
        return [
            band_entry(bands, 0, num_prompts=3, verify_ct=10, verify_tokens=int(10 * short)),
            band_entry(bands, 1, num_prompts=2, verify_ct=10, verify_tokens=int(10 * long)),
            band_entry(bands, 2, num_prompts=0, verify_ct=0, verify_tokens=0),
        ]

    rows = [
        _timed_row("no_spec", None, [1.0, 1.1, 0.9]),
        _timed_row("eagle3", "7,1,8", [0.5, 0.6, 0.55], entries(3.1, 1.3), draft_s_per_token=0.0006),
        _timed_row("ngram", "7,1,8", [0.8, 0.9, 0.85], entries(1.5, 1.2)),
    ]
    sets = {"heldout_sharegpt": {"num_prompts": 5, "source": "x", "num_left_out_over_context": 2}}
    return results_document(attach_speedups(rows), "inprocess", sets)


def test_headline_is_the_training_length_band_and_names_its_configuration():
    head = headline(_banded_results()["rows"])
    assert head["acceptance_length"] == 3.1
    assert head["acceptance_length_all_prompts"] == 2.5
    assert (
        head["headline_config"] == "eagle3 at 7,1,8 on heldout_sharegpt, prompts of 1–512 tokens (the training length)"
    )
    # the rivals at the same configuration, set and band (no untrained row in these results)
    assert head["ngram_acceptance_length"] == 1.5 and "untrained_acceptance_length" not in head


def test_headline_speedup_carries_the_spread_of_its_rounds_beside_the_ratio_of_medians():
    head = headline(_banded_results()["rows"])
    eagle = next(r for r in _banded_results()["rows"] if r["method"] == "eagle3")
    assert (head["speedup"], head["speedup_min"], head["speedup_max"]) == tuple(
        round(eagle[k], 3) for k in ("speedup", "speedup_min", "speedup_max")
    )
    assert head["speedup_min"] <= head["speedup"] <= head["speedup_max"] and "speedup_of_medians" in head


def test_report_shows_bands_spread_left_out_prompts_and_says_cpu_speedups_do_not_predict_gpu_serving():
    md, _, _ = render_report(_banded_results())
    assert "| method | config | 1–512 (training length) | 513–2048 | > 2048 |" in md
    assert "| eagle3 | 7,1,8 | 3.100 | 1.300 | – |" in md
    assert (
        "**Headline:** eagle3 at 7,1,8 on heldout_sharegpt, prompts of 1–512 tokens (the training length): "
        "acceptance length 3.100 (all prompts 2.500)" in md
    )
    assert "CPU speed-ups do not predict GPU serving" in md
    assert "one drafter step costs 0.06 of a target decode step" in md  # 0.0006 s/token × 100 tok/s
    assert "not the ratio of the two median tokens/s" in md and "speedup_of_medians" in md
    assert "3 interleaved rounds" in md and "| 1.83× (1.64–2.00) | 181.8 (166.7–200.0) |" in md
    assert "| heldout_sharegpt | 5 | 2 | x |" in md


def test_a_timing_change_inside_both_runs_spread_is_not_called_better_or_worse():
    previous = _banded_results()
    current = copy.deepcopy(previous)
    eagle = next(r for r in current["rows"] if r["method"] == "eagle3")
    eagle["tokens_per_s"] *= 1.05  # +5%, but both runs' min–max ranges overlap
    verdicts = {c["metric"]: c["verdict"] for c in compare_results(current, previous) if c["method"] == "eagle3"}
    assert verdicts["tokens_per_s"] == "same (within spread)"
    eagle["tokens_per_s_min"], eagle["tokens_per_s_max"] = 300.0, 320.0  # now clear of the previous range
    eagle["tokens_per_s"] = 310.0
    verdicts = {c["metric"]: c["verdict"] for c in compare_results(current, previous) if c["method"] == "eagle3"}
    assert verdicts["tokens_per_s"] == "better"


def test_sampled_rows_are_reported_beside_greedy_and_paired_with_no_speculation_at_their_temperature():
    rows = [
        _row("s", "no_spec", None, 50.0) | {"temperature": 0.0},
        _row("s", "eagle3", "3,1,4", 110.0, verify_tokens=300, verify_ct=100) | {"temperature": 0.0},
        _row("s", "no_spec", None, 40.0) | {"temperature": 0.8},
        _row("s", "eagle3", "3,1,4", 60.0, verify_tokens=200, verify_ct=100) | {"temperature": 0.8},
    ]
    rows = attach_speedups(rows)
    assert [round(r["speedup"], 3) for r in rows] == [1.0, 2.2, 1.0, 1.5]  # each over no_spec of its temperature
    head = headline(rows)
    assert head["acceptance_length"] == 3.0 and head["acceptance_length_t0.8"] == 2.0
    md, _, _ = render_report(results_document(rows, "inprocess", {}), None, embed_images=False)
    greedy, sampled = md.split("## s, sampled at temperature 0.8")
    assert "| eagle3 | 3,1,4 | 3.000 |" in greedy and "| eagle3 | 3,1,4 | 2.000 |" in sampled
    previous = results_document([dict(r) for r in rows[:2]], "inprocess", {})  # a run from before temperatures
    verdicts = {
        (c["temperature"], c["metric"]): c["verdict"]
        for c in compare_results(results_document(rows, "inprocess", {}), previous)
        if c["method"] == "eagle3"
    }
    assert verdicts[(0.0, "acceptance_length")] == "same" and verdicts[(0.8, "acceptance_length")] == "new"
