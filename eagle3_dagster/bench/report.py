"""The benchmark's result rows and the report rendered from them.

Owns the row schema both benchmarks produce (in-process `specdec` and served
`served`), speed-ups over no speculation, the comparison with the previous
run's results JSON, and the markdown + PNG plots the Dagster UI shows. It does
not run anything and imports neither torch nor an HTTP client.

A results document: {"format_version", "mode": "inprocess"|"served", "rows": [row...],
"sets": {name: {"num_prompts", "source"}}, "meta": {...}}; a row is what
`make_row` returns, plus `temperature` (0 = greedy; rows without it, from
earlier runs, are greedy). Speed-ups, comparisons and tables pair rows of the
same temperature; the headline is greedy, with the sampled acceptance beside it.
"""

from __future__ import annotations

import base64
import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend must be chosen before pyplot loads

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


@dataclass(frozen=True)
class LengthBands:
    """Prompt-length bands for acceptance: inclusive upper edges, ascending, the last band open.

    A drafter trained on samples of `training_length` tokens is measured where it was trained
    (the band ending there) apart from longer prompts, which it has never seen positions of.
    """

    edges: tuple[int, ...]
    training_length: int | None = None

    @classmethod
    def for_training(cls, training_length: int, serving_context: int) -> "LengthBands":
        return cls(tuple(sorted({min(training_length, serving_context), serving_context})), training_length)

    @property
    def labels(self) -> list[str]:
        lows = [1, *(e + 1 for e in self.edges)]
        out = [f"{lo}–{hi}" for lo, hi in zip(lows, self.edges)]
        return out + [f"> {self.edges[-1]}"]

    def index(self, prompt_tokens: int) -> int:
        return next((i for i, e in enumerate(self.edges) if prompt_tokens <= e), len(self.edges))

    def is_training_band(self, i: int) -> bool:
        return self.training_length is not None and i < len(self.edges) and self.edges[i] == self.training_length


def band_entry(
    bands: LengthBands,
    i: int,
    *,
    num_prompts: int,
    verify_ct: int,
    verify_tokens: int,
    accepted_by_position: Sequence[int] = (),
    has_spec: bool = True,
) -> dict:
    """Acceptance of one prompt-length band, counted like a row."""
    return {
        "band": bands.labels[i],
        "max_prompt_tokens": bands.edges[i] if i < len(bands.edges) else None,
        "training_band": bands.is_training_band(i),
        "num_prompts": num_prompts,
        "verify_ct": verify_ct,
        "acceptance_length": verify_tokens / verify_ct if has_spec and verify_ct else None,
        "accept_rate_by_position": [a / verify_ct for a in accepted_by_position] if verify_ct else [],
    }


def temperature_of(row: dict) -> float:
    return float(row.get("temperature") or 0.0)


def _median_and_spread(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def attach_speedups(rows: list[dict]) -> list[dict]:
    """Speed-up = tokens/s over the same set's no-speculation tokens/s.

    Rows timed over several interleaved rounds (`wall_s_rounds`) get per-round figures: the
    speed-up of round i divides by no_spec's tokens/s of the same round; rows carry the median
    and the spread (`*_min`, `*_max`) of tokens/s and speed-up. The median of ratios is not the
    ratio of the two median tokens/s a reader sees side by side, so every row with a speed-up also
    carries that ratio (`speedup_of_medians`); the two differ when rounds vary in load.
    """
    for r in rows:
        walls = r.get("wall_s_rounds")
        if walls:
            per_round = [r["completion_tokens"] / w if w > 0 else 0.0 for w in walls]
            r["tokens_per_s_rounds"] = per_round
            r["tokens_per_s"], r["tokens_per_s_min"], r["tokens_per_s_max"] = _median_and_spread(per_round)
    base = {(r["set"], temperature_of(r)): r for r in rows if r["method"] == BASELINE}
    for r in rows:
        b = base.get((r["set"], temperature_of(r)))
        if b is None or not b["tokens_per_s"] or r["tokens_per_s"] is None:
            r["speedup"] = None
            continue
        r["speedup_of_medians"] = r["tokens_per_s"] / b["tokens_per_s"]
        mine, theirs = r.get("tokens_per_s_rounds"), b.get("tokens_per_s_rounds")
        if mine and theirs and len(mine) == len(theirs):
            per_round = [m / t for m, t in zip(mine, theirs) if t]
            r["speedup_rounds"] = per_round
            r["speedup"], r["speedup_min"], r["speedup_max"] = _median_and_spread(per_round)
        else:
            r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"]
    return rows


def draft_target_cost_ratio(rows: list[dict], method: str = "eagle3") -> float | None:
    """Seconds per drafted token over seconds per target decode step (no_spec), on the same sets."""
    ratios = []
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b["set"] == r["set"] and b["method"] == BASELINE and temperature_of(b) == temperature_of(r)
            ),
            None,
        )
        if r["method"] == method and r.get("draft_s_per_token") and base and base.get("tokens_per_s"):
            ratios.append(r["draft_s_per_token"] * base["tokens_per_s"])
    return statistics.median(ratios) if ratios else None


def headline(rows: list[dict]) -> dict:
    """The figures a reader looks at first: the trained drafter at the first configuration on the first set,
    in the band it was trained on, and its rivals (the untrained drafter, n-gram) at the same place.

    A fixed choice, named (`headline_config`), so two reports' headlines compare like with like;
    rows without bands (served) fall back to all prompts.
    """
    trained = [r for r in rows if r["method"] == "eagle3" and r.get("spec") and not temperature_of(r)]
    if not trained:
        return {}
    row = trained[0]
    band = next((b for b in row.get("bands", []) if b["training_band"] and b["acceptance_length"] is not None), None)
    out = {
        "headline_config": f"eagle3 at {row['spec']} on {row['set']}, "
        + (f"prompts of {band['band']} tokens (the training length)" if band else "all prompts"),
        "spec": row["spec"],
        "set": row["set"],
    }
    out["acceptance_length"] = round(float((band or row)["acceptance_length"]), 4)
    if band:
        out["acceptance_length_all_prompts"] = round(float(row["acceptance_length"]), 4)
        out["headline_band"] = band["band"]
    if row.get("speedup") is not None:
        out["speedup"] = round(float(row["speedup"]), 3)  # all prompts: speed is not split by band
        for k in ("speedup_min", "speedup_max"):  # the rounds' spread, as the grid shows it
            if row.get(k) is not None:
                out[k] = round(float(row[k]), 3)
        out["speedup_of_medians"] = round(float(row["speedup_of_medians"]), 3)  # what the two tokens/s cells give
    for r in rows:  # the same configuration sampled, in the same band
        if r["method"] == "eagle3" and (r["set"], r["spec"]) == (row["set"], row["spec"]) and temperature_of(r):
            b = next((x for x in r.get("bands", []) if band and x["band"] == band["band"]), None)
            value = (b or r)["acceptance_length"]
            if value is not None:
                out[f"acceptance_length_t{temperature_of(r):g}"] = round(float(value), 4)
    for method, key in [("eagle3_untrained", "untrained_acceptance_length"), ("ngram", "ngram_acceptance_length")]:
        rival = next(
            (
                r
                for r in rows
                if r["method"] == method
                and not temperature_of(r)
                and (r["set"], r.get("spec")) == (row["set"], row["spec"])
            ),
            None,
        )
        value = (
            None
            if rival is None
            else rival.get("acceptance_length")
            if not band
            else next((b["acceptance_length"] for b in rival.get("bands", []) if b["band"] == band["band"]), None)
        )
        if value is not None:
            out[key] = round(float(value), 4)
    return out


def results_document(rows: list[dict], mode: str, sets: dict[str, dict], meta: dict | None = None) -> dict:
    return {"format_version": RESULTS_FORMAT_VERSION, "mode": mode, "rows": rows, "sets": sets, "meta": meta or {}}


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _key(r: dict) -> tuple[str, str, str, float]:
    return (r["set"], r["method"], r["spec"] or "-", temperature_of(r))


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(
        rows, key=lambda r: (temperature_of(r), _METHOD_ORDER.get(r["method"], 9), r["method"], r["spec"] or "")
    )


def _config(r: dict) -> str:
    return (r["spec"] or "–") + (f" @ T={temperature_of(r):g}" if temperature_of(r) else "")


def _overlap(a: dict, b: dict, metric: str) -> bool:
    """Both timed over rounds and their min–max ranges overlap."""
    lo, hi = f"{metric}_min", f"{metric}_max"
    if None in (a.get(lo), a.get(hi), b.get(lo), b.get(hi)):
        return False
    return a[lo] <= b[hi] and b[lo] <= a[hi]


def compare_results(current: dict, previous: dict) -> list[dict]:
    """Per (set, method, spec) and metric: previous, current, change, and whether it is better."""
    prev = {_key(r): r for r in previous.get("rows", [])}
    out = []
    for r in current["rows"]:
        p: dict = prev.get(_key(r)) or {}
        for metric in ("acceptance_length", "speedup", "tokens_per_s"):
            now, before = r.get(metric), p.get(metric)
            if now is None and before is None:
                continue
            entry = {
                "set": r["set"],
                "method": r["method"],
                "spec": r["spec"],
                "temperature": temperature_of(r),
                "metric": metric,
                "previous": before,
                "current": now,
                "change": None,
                "relative": None,
                "verdict": "new",
            }
            if before is not None and now is not None:
                entry["change"] = now - before
                entry["relative"] = (now - before) / before if before else None
                rel = entry["relative"] or 0.0
                entry["verdict"] = "same" if abs(rel) < SAME_WITHIN else ("better" if rel > 0 else "worse")
                if entry["verdict"] != "same" and _overlap(r, p, metric):
                    entry["verdict"] = "same (within spread)"  # timing noise, not a change
            elif before is not None:
                entry["verdict"] = "missing"
            out.append(entry)
    return out


def _fmt(v: Any, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _spread(r: dict, key: str, digits: int, unit: str = "") -> str:
    if r.get(key) is None:
        return "–"
    text = f"{r[key]:.{digits}f}{unit}"
    if r.get(f"{key}_min") is not None:
        text += f" ({r[f'{key}_min']:.{digits}f}–{r[f'{key}_max']:.{digits}f})"
    return text


def _set_table(rows: list[dict]) -> list[str]:
    lines = [
        "| method | config | acceptance length | speed-up | tokens/s | acceptance by draft position | prompts | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in _sorted(rows):
        by_pos = " ".join(f"{a:.2f}" for a in r["accept_rate_by_position"]) or "–"
        lines.append(
            f"| {r['method']} | {r['spec'] or '–'} | {_fmt(r['acceptance_length'])} | {_spread(r, 'speedup', 2, '×')} | "
            f"{_spread(r, 'tokens_per_s', 1)} | {by_pos} | {r['num_prompts']} | {r['completion_tokens']} |"
        )
    return lines


def _band_table(rows: list[dict]) -> list[str]:
    spec_rows = [r for r in _sorted(rows) if r.get("bands") and r["spec"]]
    if not spec_rows:
        return []
    labels = [b["band"] + (" (training length)" if b["training_band"] else "") for b in spec_rows[0]["bands"]]
    lines = [
        "",
        "Acceptance length by prompt length (tokens); prompts per band: "
        + ", ".join(f"{b['band']}: {b['num_prompts']}" for b in spec_rows[0]["bands"]),
        "",
        "| method | config | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for r in spec_rows:
        lines.append(
            f"| {r['method']} | {r['spec']} | " + " | ".join(_fmt(b["acceptance_length"]) for b in r["bands"]) + " |"
        )
    return lines


def _caveats(results: dict) -> list[str]:
    rows = results["rows"]
    md = []
    rounds = max((len(r.get("wall_s_rounds", [])) for r in rows), default=0)
    if rounds:
        md.append(
            f"Timing: every method warmed up once, then {rounds} interleaved rounds over the whole set; "
            "tokens/s and speed-up are the median round, (min–max) the spread across rounds. Speed-up is "
            "the median of per-round ratios (each over no_spec's same round), not the ratio of the two "
            "median tokens/s; that ratio is `speedup_of_medians` in results.json."
        )
        once = sorted({r["method"] for r in rows if r.get("timed_rounds") == 1})
        if once:
            md.append(
                f"Controls run once, for their acceptance, not timed over the rounds: {', '.join(once)}; "
                "their tokens/s and speed-up are that one round's."
            )
    if results.get("mode") == "inprocess":
        ratio = draft_target_cost_ratio(rows)
        cost = f" Here one drafter step costs {ratio:.2f} of a target decode step." if ratio is not None else ""
        md.append(
            "**CPU speed-ups do not predict GPU serving.** Speed-up depends on the draft/target cost ratio "
            f"and on how verification batches on the hardware.{cost} A served MoE target on GPUs has a "
            "different ratio and batch economics; acceptance length is the figure that carries over."
        )
    return md


def _comparison_table(comparison: list[dict]) -> list[str]:
    lines = [
        "| set | method | config | metric | previous | current | change | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparison:
        rel = f" ({c['relative']:+.1%})" if c["relative"] is not None else ""
        change = f"{c['change']:+.3f}{rel}" if c["change"] is not None else "–"
        lines.append(
            f"| {c['set']} | {c['method']} | {_config(c)} | {c['metric']} | "
            f"{_fmt(c['previous'])} | {_fmt(c['current'])} | {change} | {c['verdict']} |"
        )
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
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{r['set']} · {r['method']} {_config(r)}")
    ax.set(
        xlabel="draft position",
        ylabel="fraction of verify steps accepting it",
        ylim=(0, 1.05),
        title="Acceptance by draft position",
    )
    if ax.lines:
        ax.legend(fontsize=7)
    return _png(fig)


def plot_acceptance_by_set(rows: list[dict]) -> bytes:
    spec_rows = [r for r in rows if r["acceptance_length"] is not None]
    sets = list(dict.fromkeys(r["set"] for r in rows))
    series = list(dict.fromkeys((r["method"], _config(r)) for r in _sorted(spec_rows)))
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(sets) + 3), 4))
    width = 0.8 / max(1, len(series))
    for i, (method, spec) in enumerate(series):
        values = {r["set"]: r["acceptance_length"] for r in spec_rows if (r["method"], _config(r)) == (method, spec)}
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
        md += [
            "| prompt set | prompts | left out (prompt + max_new_tokens over the serving context) | source |",
            "|---|---|---|---|",
        ]
        md += [
            f"| {name} | {s.get('num_prompts', '?')} | {s.get('num_left_out_over_context', '–')} | "
            f"{s.get('source', '?')} |"
            for name, s in results["sets"].items()
        ]
        md.append("")
    head = headline(rows)
    if head:
        md += [
            f"**Headline:** {head['headline_config']}: acceptance length {head['acceptance_length']:.3f}"
            + (
                f" (all prompts {head['acceptance_length_all_prompts']:.3f})"
                if "acceptance_length_all_prompts" in head
                else ""
            ),
            "",
        ]
    md.append(
        "Acceptance length = tokens committed per verify step (bonus token included); speed-up is tokens/s "
        "over no speculation on the same set."
    )
    md += [line for c in _caveats(results) for line in ("", c)]
    for set_name, temperature in dict.fromkeys((r["set"], temperature_of(r)) for r in rows):
        set_rows = [r for r in rows if r["set"] == set_name and temperature_of(r) == temperature]
        title = (
            set_name
            if not temperature
            else (
                f"{set_name}, sampled at temperature {temperature:g} (SGLang's lossless rejection rule; "
                "speed-up over plain sampling at the same temperature)"
            )
        )
        md += ["", f"## {title}", ""] + _set_table(set_rows) + _band_table(set_rows)
    for name, png in pngs.items():
        target = png_data_uri(png) if embed_images else name
        md += ["", f"![{name.removesuffix('.png')}]({target})"]
    md += ["", "## Compared with the previous run", ""]
    if previous is None:
        md.append("No previous results: this is the first run.")
    else:
        comparison = compare_results(results, previous)
        counts = {v: sum(c["verdict"] == v for c in comparison) for v in ("better", "worse", "same")}
        noise = sum(c["verdict"] == "same (within spread)" for c in comparison)
        md.append(
            f"{counts['better']} better, {counts['worse']} worse, {counts['same']} unchanged "
            f"(within {SAME_WITHIN:.0%})" + (f", {noise} timing changes inside the rounds' spread." if noise else ".")
        )
        md += [""] + _comparison_table(comparison)
    return "\n".join(md) + "\n", results, pngs
