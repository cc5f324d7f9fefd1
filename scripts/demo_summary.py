"""The demo's closing summary: each stage's seconds and the headline figures, beside their expected ranges.

The ranges are written once, in docs/demo_figures.yaml; the README's table of them is rendered from it
(`python scripts/demo_summary.py --markdown`, checked by tests/unit/test_demo_summary.py).
`scripts/run_pipeline.py` prints the summary after the stages it ran, from the latest materializations.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "demo_figures.yaml"
OUTSIDE = "  <- outside the range"
# The README's table of the ranges sits between these lines.
README_BEGIN = "<!-- rendered from docs/demo_figures.yaml by scripts/demo_summary.py --markdown -->"
README_END = "<!-- end of the table rendered from docs/demo_figures.yaml -->"


def load(path: Path = FIGURES) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _span(bounds: list[float] | None) -> str:
    return "–" if not bounds else f"{_number(bounds[0])}–{_number(bounds[1])}"


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 100:
        return f"{int(value):,}"
    return f"{value:.3f}" if abs(value) < 1 else f"{value:.2f}" if abs(value) < 100 else f"{value:,.0f}"


def _outside(shown: str, bounds: list[float] | None) -> bool:
    """Whether a value, as the summary shows it, is outside `bounds`: the mark agrees with the figure beside it
    (4.6 s, shown as 5, is inside 5–60)."""
    try:
        value = float(shown.replace(",", ""))
    except ValueError:  # not a number
        return False
    return bool(bounds) and not bounds[0] <= value <= bounds[1]


def summary(
    profile: str,
    seconds: Mapping[str, float],
    metadata: Mapping[str, Mapping[str, Any]],
    expected: Mapping[str, Any] | None = None,
) -> str:
    """The summary's text. `seconds`: stage → wall seconds, in the order run; `metadata`: asset → its latest
    materialization's metadata values (the assets of the stages run). Ranges apply to their own profile only."""
    expected = load() if expected is None else expected
    ranges = expected if expected.get("profile") == profile else {"seconds": {}, "figures": []}
    where = f"expected: {FIGURES.relative_to(ROOT)}" if ranges["figures"] else f"no expected ranges for {profile}"
    lines = [f"summary ({where})", f"  {'stage':<40}{'seconds':>10}   expected"]
    for stage, s in seconds.items():
        bounds = ranges["seconds"].get(stage)
        shown = f"{s:.0f}"
        lines.append(f"  {stage:<40}{shown:>10}   {_span(bounds)}{OUTSIDE if _outside(shown, bounds) else ''}")
    lines.append(f"  {'figure':<40}{'value':>10}   expected")
    for figure in ranges["figures"] or _all_figures(expected, metadata):
        meta = metadata.get(figure["asset"])
        if meta is None or figure["key"] not in meta:
            continue
        shown, bounds = _number(meta[figure["key"]]), figure.get("range")
        lines.append(f"  {figure['what']:<40}{shown:>10}   {_span(bounds)}{OUTSIDE if _outside(shown, bounds) else ''}")
    return "\n".join(lines)


def _all_figures(expected: Mapping[str, Any], metadata: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """Another profile's run: the same figures, without ranges."""
    return [{k: v for k, v in f.items() if k != "range"} for f in expected["figures"]]


def latest_metadata(instance, assets: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Each asset's latest materialization metadata, as plain values."""
    import dagster as dg

    out = {}
    for asset in assets:
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
        if event is not None and event.asset_materialization is not None:
            out[asset] = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    return out


def markdown(expected: Mapping[str, Any] | None = None) -> str:
    """The README's table of the expected ranges."""
    expected = load() if expected is None else expected
    lines = ["| stage | seconds | figure | expected |", "|---|---:|---|---:|"]
    stages = dict(expected["seconds"])
    by_stage: dict[str, list[dict]] = {}
    for figure in expected["figures"]:
        by_stage.setdefault(figure["stage"], []).append(figure)
    for stage, bounds in stages.items():
        figures = by_stage.get(stage, [])
        first, rest = (figures[0], figures[1:]) if figures else (None, [])
        cells = [f"`{first['asset']}`: {first['what']}", _span(first["range"])] if first else ["", ""]
        lines.append(f"| {stage} | {_span(bounds)} | {cells[0]} | {cells[1]} |")
        for f in rest:
            lines.append(f"| | | `{f['asset']}`: {f['what']} | {_span(f['range'])} |")
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    """The README's table of the ranges, as it stands."""
    return readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the README's table of the expected ranges")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown())
    else:
        print(yaml.safe_dump(load(), sort_keys=False, allow_unicode=True), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
