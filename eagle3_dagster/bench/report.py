"""The benchmark's result rows and the report rendered from them.

Owns the row schema both benchmarks produce (in-process `specdec` and served
`served`), speed-ups over no speculation, the comparison with the previous
run's results JSON, and the markdown + PNG plots the Dagster UI shows. It does
not run anything and imports neither torch nor an HTTP client.

A results document: {"format_version", "mode": "inprocess"|"served", "rows": [row...],
"sets": {name: {"num_prompts", "source"}}, "meta": {...}}; a row is what
`make_row` returns.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)

RESULTS_FORMAT_VERSION = 1
BASELINE = "no_spec"
_METHOD_ORDER = {"no_spec": 0, "eagle3": 1, "eagle3_untrained": 2, "ngram": 3}
# Relative changes smaller than this are reported as unchanged: run-to-run timing noise on a busy host.
SAME_WITHIN = 0.01


def make_row(
    set_name: str,
    method: str,
    spec: str | None,
    *,
    num_prompts: int,
    prompt_tokens: int,
    completion_tokens: int,
    wall_s: float,
    verify_ct: int,
    verify_tokens: int,
    accepted_by_position: Sequence[int] = (),
    **extra: Any,
) -> dict:
    """Acceptance length = verify-step tokens / verify steps (bonus included), as SGLang counts it."""
    return {
        "set": set_name,
        "method": method,
        "spec": spec,
        "num_prompts": num_prompts,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "wall_s": wall_s,
        "tokens_per_s": completion_tokens / wall_s if wall_s > 0 else None,
        "verify_ct": verify_ct,
        "acceptance_length": verify_tokens / verify_ct if spec and verify_ct else None,
        "accept_rate_by_position": [a / verify_ct for a in accepted_by_position] if verify_ct else [],
        "speedup": None,
        **extra,
    }


def attach_speedups(rows: list[dict]) -> list[dict]:
    """Speed-up = tokens/s over the same set's no-speculation tokens/s."""
    base = {r["set"]: r["tokens_per_s"] for r in rows if r["method"] == BASELINE}
    for r in rows:
        b = base.get(r["set"])
        r["speedup"] = r["tokens_per_s"] / b if b and r["tokens_per_s"] is not None else None
    return rows


def results_document(rows: list[dict], mode: str, sets: dict[str, dict], meta: dict | None = None) -> dict:
    return {"format_version": RESULTS_FORMAT_VERSION, "mode": mode, "rows": rows, "sets": sets, "meta": meta or {}}


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _key(r: dict) -> tuple[str, str, str]:
    return (r["set"], r["method"], r["spec"] or "-")


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (_METHOD_ORDER.get(r["method"], 9), r["method"], r["spec"] or ""))


def compare_results(current: dict, previous: dict) -> list[dict]:
    """Per (set, method, spec) and metric: previous, current, change, and whether it is better."""
    prev = {_key(r): r for r in previous.get("rows", [])}
    out = []
    for r in current["rows"]:
        p = prev.get(_key(r))
        for metric in ("acceptance_length", "speedup", "tokens_per_s"):
            now, before = r.get(metric), (p or {}).get(metric)
            if now is None and before is None:
                continue
            entry = {"set": r["set"], "method": r["method"], "spec": r["spec"], "metric": metric,
                     "previous": before, "current": now, "change": None, "relative": None, "verdict": "new"}
            if before is not None and now is not None:
                entry["change"] = now - before
                entry["relative"] = (now - before) / before if before else None
                rel = entry["relative"] or 0.0
                entry["verdict"] = "same" if abs(rel) < SAME_WITHIN else ("better" if rel > 0 else "worse")
            elif before is not None:
                entry["verdict"] = "missing"
            out.append(entry)
    return out


def _fmt(v: Any, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _set_table(rows: list[dict]) -> list[str]:
    lines = [
        "| method | config | acceptance length | speed-up | tokens/s | acceptance by draft position | prompts | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in _sorted(rows):
        by_pos = " ".join(f"{a:.2f}" for a in r["accept_rate_by_position"]) or "–"
        lines.append(
            f"| {r['method']} | {r['spec'] or '–'} | {_fmt(r['acceptance_length'])} | {_fmt(r['speedup'], 2)}{'×' if r['speedup'] is not None else ''} | "
            f"{_fmt(r['tokens_per_s'], 1)} | {by_pos} | {r['num_prompts']} | {r['completion_tokens']} |"
        )
    return lines


def _comparison_table(comparison: list[dict]) -> list[str]:
    lines = ["| set | method | config | metric | previous | current | change | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparison:
        rel = f" ({c['relative']:+.1%})" if c["relative"] is not None else ""
        change = f"{c['change']:+.3f}{rel}" if c["change"] is not None else "–"
        lines.append(f"| {c['set']} | {c['method']} | {c['spec'] or '–'} | {c['metric']} | "
                     f"{_fmt(c['previous'])} | {_fmt(c['current'])} | {change} | {c['verdict']} |")
    return lines


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def plot_acceptance_by_position(rows: list[dict]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in _sorted(rows):
        rates = r["accept_rate_by_position"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{r['set']} · {r['method']} {r['spec']}")
    ax.set(xlabel="draft position", ylabel="fraction of verify steps accepting it", ylim=(0, 1.05),
           title="Acceptance by draft position")
    if ax.lines:
        ax.legend(fontsize=7)
    return _png(fig)


def plot_acceptance_by_set(rows: list[dict]) -> bytes:
    spec_rows = [r for r in rows if r["acceptance_length"] is not None]
    sets = list(dict.fromkeys(r["set"] for r in rows))
    series = list(dict.fromkeys((r["method"], r["spec"]) for r in _sorted(spec_rows)))
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(sets) + 3), 4))
    width = 0.8 / max(1, len(series))
    for i, (method, spec) in enumerate(series):
        values = {r["set"]: r["acceptance_length"] for r in spec_rows if (r["method"], r["spec"]) == (method, spec)}
        xs = [j + i * width for j, s in enumerate(sets) if s in values]
        ax.bar(xs, [values[s] for s in sets if s in values], width, label=f"{method} {spec}")
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(sets))], sets)
    ax.set(ylabel="acceptance length (tokens / verify step)", title="Acceptance length per prompt set")
    if series:
        ax.legend(fontsize=7)
    return _png(fig)


def render_report(
    results: dict, previous: dict | None = None, *, embed_images: bool = True
) -> tuple[str, dict, dict[str, bytes]]:
    """Markdown (tables per set, plots, comparison), the raw results JSON, and the PNGs by file name."""
    rows = results["rows"]
    pngs = {
        "acceptance_by_position.png": plot_acceptance_by_position(rows),
        "acceptance_by_set.png": plot_acceptance_by_set(rows),
    }
    md = [f"# Speculative decoding benchmark ({results.get('mode', '?')})", ""]
    if results.get("sets"):
        md += ["| prompt set | prompts | source |", "|---|---|---|"]
        md += [f"| {name} | {s.get('num_prompts', '?')} | {s.get('source', '?')} |"
               for name, s in results["sets"].items()]
        md.append("")
    md.append("Acceptance length = tokens committed per verify step (bonus token included); speed-up is tokens/s "
              "over no speculation on the same set.")
    for set_name in dict.fromkeys(r["set"] for r in rows):
        md += ["", f"## {set_name}", ""] + _set_table([r for r in rows if r["set"] == set_name])
    for name, png in pngs.items():
        target = png_data_uri(png) if embed_images else name
        md += ["", f"![{name.removesuffix('.png')}]({target})"]
    md += ["", "## Compared with the previous run", ""]
    if previous is None:
        md.append("No previous results: this is the first run.")
    else:
        comparison = compare_results(results, previous)
        counts = {v: sum(c["verdict"] == v for c in comparison) for v in ("better", "worse", "same")}
        md.append(f"{counts['better']} better, {counts['worse']} worse, {counts['same']} unchanged "
                  f"(within {SAME_WITHIN:.0%}).")
        md += [""] + _comparison_table(comparison)
    return "\n".join(md) + "\n", results, pngs
