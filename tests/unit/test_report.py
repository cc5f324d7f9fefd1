"""The benchmark report: tables per set, plots, raw JSON and the comparison with the previous run."""

from __future__ import annotations

import base64
import copy

import orjson

from eagle3_dagster.bench.report import (
    attach_speedups,
    compare_results,
    make_row,
    png_data_uri,
    render_report,
    results_document,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(set_name, method, spec, tokens_per_s, verify_tokens=0, verify_ct=0, accepted=()):
    return make_row(set_name, method, spec, num_prompts=4, prompt_tokens=100, completion_tokens=int(tokens_per_s * 2),
                    wall_s=2.0, verify_ct=verify_ct, verify_tokens=verify_tokens, accepted_by_position=accepted)


def _results(eagle_tokens: int = 300) -> dict:
    rows = []
    for s in ("heldout_sharegpt", "gsm8k"):
        rows += [
            _row(s, "no_spec", None, 50.0),
            _row(s, "eagle3", "3,1,4", 110.0, verify_tokens=eagle_tokens, verify_ct=100, accepted=(90, 70, 40)),
            _row(s, "eagle3_untrained", "3,1,4", 45.0, verify_tokens=102, verify_ct=100, accepted=(2, 0, 0)),
            _row(s, "ngram", "3,1,4", 60.0, verify_tokens=140, verify_ct=100, accepted=(30, 8, 2)),
        ]
    sets = {"heldout_sharegpt": {"num_prompts": 4, "source": "sharegpt heldout 5%"},
            "gsm8k": {"num_prompts": 4, "source": "/data/gsm8k.jsonl"}}
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
    assert orjson.loads(orjson.dumps(raw)) == results


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
