"""The demo's closing summary (scripts/demo_summary.py): each stage's seconds and the headline figures beside
the expected ranges of docs/demo_figures.yaml, which is the one place they are written."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import demo_summary  # noqa: E402  (scripts/ is put on sys.path above)


def test_every_figure_names_a_stage_and_a_range_and_the_stages_are_the_pipelines() -> None:
    expected = demo_summary.load()
    assert expected["profile"] == "demo"
    assert list(expected["seconds"]) == ["set-up", "dagster dev", "target", "data", "corpus", "extract", "train"]
    for figure in expected["figures"]:
        assert figure["stage"] in expected["seconds"], figure
        low, high = figure["range"]
        assert low <= high, figure


def test_the_summary_prints_each_figure_beside_its_range_and_marks_one_outside() -> None:
    expected = demo_summary.load()
    metadata = {"target_model": {"final_loss": 4.6}, "drafter_checkpoint": {"heldout_acc_0": 0.5}}
    text = demo_summary.summary("demo", {"target": 230.0, "train": 9999.0}, metadata, expected)
    lines = {line.split("  ")[1].strip(): line for line in text.splitlines()[1:] if line.startswith("  ")}
    assert "4.60" in lines["pre-training loss, mean of the last 20 steps"]
    assert "4.50–4.70" in lines["pre-training loss, mean of the last 20 steps"]
    assert demo_summary.OUTSIDE not in lines["pre-training loss, mean of the last 20 steps"]
    assert lines["held-out acc_0"].endswith(demo_summary.OUTSIDE)
    assert lines["train"].endswith(demo_summary.OUTSIDE) and not lines["target"].endswith(demo_summary.OUTSIDE)
    assert "records merged" not in text  # no metadata for it: not a stage this run ran


def test_a_value_is_judged_as_it_is_shown() -> None:
    """A fresh clone's demo printed 'dagster dev  5   5–60  <- outside the range' for 4.6 s: the mark must agree
    with the figure beside it, and a value shown as outside must read as outside."""
    expected = demo_summary.load()
    low, high = expected["seconds"]["dagster dev"]
    metadata = {"drafter_checkpoint": {"heldout_acc_0": expected_low(expected, "heldout_acc_0") - 0.0004}}
    text = demo_summary.summary("demo", {"dagster dev": low - 0.4, "target": high + 1}, metadata, expected)
    lines = {line.split("  ")[1].strip(): line for line in text.splitlines()[1:] if line.startswith("  ")}
    assert lines["dagster dev"].split()[2] == f"{low:.0f}" and demo_summary.OUTSIDE not in lines["dagster dev"]
    assert demo_summary.OUTSIDE not in lines["held-out acc_0"]  # shown as the range's lower bound
    text = demo_summary.summary("demo", {"dagster dev": low - 0.6}, {}, expected)
    assert text.splitlines()[2].endswith(demo_summary.OUTSIDE)  # shown as one second under the range


def expected_low(expected: dict, key: str) -> float:
    return next(f["range"][0] for f in expected["figures"] if f["key"] == key)


def test_another_profile_gets_its_figures_without_the_demos_ranges() -> None:
    text = demo_summary.summary("micro", {"corpus": 3.0}, {"merged_train": {"num_records": 20}})
    assert "no expected ranges for micro" in text and demo_summary.OUTSIDE not in text
    assert [line for line in text.splitlines() if "records merged" in line][0].split()[-2:] == ["20", "–"]


def test_the_readmes_table_of_the_ranges_is_rendered_from_the_figures_file() -> None:
    """The ranges are written once: edit docs/demo_figures.yaml, then paste `scripts/demo_summary.py --markdown`."""
    readme = (ROOT / "README.md").read_text()
    assert demo_summary.readme_table(readme) == demo_summary.markdown()
