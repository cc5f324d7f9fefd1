"""The SGLang releases this project supports, as read from each release's own sources.

Owns the table `patches/sglang/releases.json`, which `patches/sglang/make_patch.py`
generates from the release wheels (never edited by hand): per release, the sha256
of its pristine and patched `deepseek_v2.py`, the patch style, whether it serves
Kimi-K2.5 with EAGLE-3, how its `set_eagle3_layers_to_capture` turns a draft
config's `eagle_aux_hidden_state_layer_ids` into captured layers (found by running
that method from the release's source), and the server options an extraction
launch and a serving launch need on it, and whether it can load an MLA drafter
(`mla_drafter`: the EAGLE 3.1 options its `kimi_k25_eagle3.py` `Eagle3DeepseekV2ForCausalLM`
reads, or null where the release has no such class: before 0.5.12; every row's
`serves_kimi_k25_eagle3` is true). Everything version-dependent reads this table, so adding a
release is one command and no code change.

A leaf below the profile schema: `config` checks a profile against this table as it loads it
(`served_drafter_problem`, `refused_extraction_option`), and the GPU host's preflight checks a host's
release, without importing the `sglang` package, whose server and driver sit above them.

Aux-id rules (canonical = the state entering layer i, HF `output_hidden_states[i]`):
- `always_plus_one`: captures `[id + 1 for id in ids]` (Llama; DeepSeek <= 0.5.12);
- `plus_one_if_first_is_one`: adds 1 only when `ids[0] == 1`, else captures `ids`
  as given (DeepSeek >= 0.5.13; Kimi-K2.5 delegates to its DeepSeek language model).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parents[1] / "patches" / "sglang"
TABLE = PATCH_DIR / "releases.json"

ALWAYS_PLUS_ONE = "always_plus_one"
PLUS_ONE_IF_FIRST_IS_ONE = "plus_one_if_first_is_one"
# The EAGLE 3.1 draft-config options (`drafter.*` in a profile) a release may read from config.json.
EAGLE31_OPTIONS = ("fc_norm", "norm_output")

# Server options under which the dump would store something other than SGLang's own EAGLE-3 capture,
# or a prefill would skip rows (prefix tokens served from a cache have no hidden states; a mixed batch
# is not a plain EXTEND forward, which is all the hook dumps). The same on every release.
EXTRACTION_REFUSED_OPTIONS = {
    "--enable-flashinfer-allreduce-fusion": "layer outputs stay per-rank partial sums",
    "--enable-two-batch-overlap": "layers past the first dense ones skip the capture",
    "--enforce-piecewise-cuda-graph": "the prefill forward is replayed from a CUDA graph, without the hook",
    "--enable-dp-attention": "rows are scattered across ranks",
    "--enable-hierarchical-cache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-hicache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-session-radix-cache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--radix-cache-backend": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-lmcache": "a prefix cache: cached prompt tokens are not recomputed and have no states",
    "--enable-mixed-chunk": "decode rows join prefill chunks, a MIXED forward the dump does not capture",
    "--disaggregation-mode": "prefill/decode disaggregation moves prefixes between servers",
}


@dataclass(frozen=True)
class Release:
    version: str
    pristine_sha256: str
    patched_sha256: str
    style: str  # "loop" (<= 0.5.13) or "collector"
    serves_kimi_k25_eagle3: bool
    aux_id_rules: dict[str, str]  # architecture family ("deepseek", "llama") -> rule
    extraction_args: tuple[str, ...]  # server options an extraction launch adds on this release
    serving_args: tuple[str, ...]  # server options a serving launch (the served benchmark) adds on this release
    capture_only_mode: bool  # --enable-return-aux-hidden-states exists (not used: see README)
    eagle31_options: tuple[str, ...]  # EAGLE 3.1 draft config options its llama_eagle3.py reads (fc_norm, norm_output)
    mla_drafter: tuple[str, ...] | None = None  # the same for kimi_k25_eagle3.py; None: cannot load an MLA drafter

    @property
    def serves_mla_drafter(self) -> bool:
        """Serves Kimi-K2.5 with EAGLE-3 and loads `Eagle3DeepseekV2ForCausalLM` (drafter.attention: mla)."""
        return self.serves_kimi_k25_eagle3 and self.mla_drafter is not None

    def drafter_options(self, attention: str) -> tuple[str, ...]:
        """The EAGLE 3.1 options this release reads from the config.json of a `gqa` or `mla` drafter."""
        return self.eagle31_options if attention != "mla" else (self.mla_drafter or ())

    @property
    def patch_file(self) -> Path:
        return PATCH_DIR / f"v{self.version}" / "hs-dump.patch"

    def file_state(self, sha256: str) -> str:
        """'patched', 'unpatched' or 'modified-unknown' for this release's deepseek_v2.py whose sha256 is `sha256`."""
        if sha256 == self.pristine_sha256:
            return "unpatched"
        if sha256 == self.patched_sha256:
            return "patched"
        return "modified-unknown"


class UnsupportedRelease(ValueError):
    """A release the table does not hold; the message names the supported ones."""


@cache
def supported() -> dict[str, Release]:
    rows = json.loads(TABLE.read_text())["releases"]
    return {
        r["version"]: Release(
            version=r["version"],
            pristine_sha256=r["pristine_sha256"],
            patched_sha256=r["patched_sha256"],
            style=r["style"],
            serves_kimi_k25_eagle3=r["serves_kimi_k25_eagle3"],
            aux_id_rules=r["aux_id_rules"],
            extraction_args=tuple(r["extraction_args"]),
            serving_args=tuple(r["serving_args"]),
            capture_only_mode=r["capture_only_mode"],
            eagle31_options=tuple(r["eagle31_options"]),
            mla_drafter=None if r.get("mla_drafter") is None else tuple(r["mla_drafter"]),
        )
        for r in rows
    }


def release(version: str) -> Release:
    try:
        return supported()[version]
    except KeyError:
        raise UnsupportedRelease(
            f"SGLang {version} is not supported (supported: {', '.join(supported())}); "
            "add it with `python patches/sglang/make_patch.py add <version>`"
        ) from None


def mla_drafter_refusal(version: str) -> str | None:
    """Why SGLang `version` cannot serve an MLA drafter (drafter.attention: mla), or None when it can."""
    r = release(version)
    if r.serves_mla_drafter:
        return None
    missing = (
        "Eagle3DeepseekV2ForCausalLM (sglang/srt/models/kimi_k25_eagle3.py, from 0.5.12)"
        if r.mla_drafter is None
        else "EAGLE-3 for Kimi-K2.5"
    )
    return f"SGLang {version} cannot load an MLA drafter: it has no {missing}"


def mla_drafter_releases(options: Sequence[str] = ()) -> list[str]:
    """The supported releases that serve an MLA drafter and read all of its EAGLE 3.1 `options`."""
    return [v for v, r in supported().items() if r.serves_mla_drafter and set(options) <= set(r.mla_drafter or ())]


def arch_family(architecture: str) -> str:
    """The `set_eagle3_layers_to_capture` family of a target's HF architecture name."""
    if architecture.startswith(("Deepseek", "KimiK2", "KimiK25")):
        return "deepseek"
    if architecture.startswith("Llama"):
        return "llama"
    raise ValueError(f"target architecture {architecture!r}: no known SGLang EAGLE-3 capture rule")


def captured_layers(rule: str, ids: list[int]) -> list[int]:
    """What a release's `set_eagle3_layers_to_capture(ids)` captures, in canonical numbering."""
    if rule == ALWAYS_PLUS_ONE or (rule == PLUS_ONE_IF_FIRST_IS_ONE and ids and ids[0] == 1):
        return [i + 1 for i in ids]
    if rule == PLUS_ONE_IF_FIRST_IS_ONE:
        return list(ids)
    raise ValueError(f"unknown aux-id rule {rule!r}")


def draft_aux_ids(canonical: list[int], family: str, versions: list[str] | None = None) -> tuple[list[int], list[str]]:
    """(`eagle_aux_hidden_state_layer_ids`, the releases that capture `canonical` from them).

    With `versions` named, the ids must be right on every one of them. Otherwise the ids are the
    ones right on the most supported releases, preferring SGLang's output numbering (canonical - 1),
    which every release reads the same way when it starts at 1. Raises, naming why, when no
    release can capture `canonical` from any draft config.
    """
    pool = [release(v) for v in (versions or list(supported()))]
    best: tuple[list[int], list[str]] = ([], [])
    for ids in ([i - 1 for i in canonical], list(canonical)):
        ok = [r.version for r in pool if captured_layers(r.aux_id_rules[family], ids) == list(canonical)]
        if len(ok) > len(best[1]):
            best = (ids, ok)
    if versions and len(best[1]) != len(pool):
        wrong = [r.version for r in pool if r.version not in best[1]]
        raise ValueError(
            f"aux layers {list(canonical)} (canonical): no draft config makes SGLang {', '.join(wrong)} capture "
            f"them for a {family} target ({pool[0].aux_id_rules[family]}); choose aux layers starting at 2"
        )
    if not best[1]:
        raise ValueError(
            f"aux layers {list(canonical)} (canonical): no supported SGLang release can capture them for a "
            f"{family} target from a draft config; choose aux layers starting at 2"
        )
    return best


def other_sglang_release(report: dict, expected: str | None) -> str | None:
    """Why a host whose preflight `report` this is cannot run a step for `expected`, or None.

    The export writes its aux ids for `gpu_host.sglang_version`, and releases read them differently
    (DeepSeek: `always_plus_one` up to 0.5.12, `plus_one_if_first_is_one` from 0.5.13): a host on
    another release would extract, or serve, a set that is not the one the export names."""
    installed = report.get("sglang_version")
    if expected is None or installed is None or installed == expected:
        return None
    return (
        f"has SGLang {installed} installed, but gpu_host.sglang_version is {expected}: the drafter's aux ids "
        f"are written for {expected}, and another release may read them as other layers; install SGLang "
        f"{expected} there or set gpu_host.sglang_version to {installed}"
    )


def refused_extraction_option(args: Sequence[str]) -> str | None:
    """Why an extraction server cannot run with these options (naming the first bad one), or None."""
    for arg in args:
        option = arg.split("=")[0]
        if option in EXTRACTION_REFUSED_OPTIONS:
            return (
                f"hidden-state extraction cannot run with {option}: {EXTRACTION_REFUSED_OPTIONS[option]}; "
                "remove it from the server options"
            )
    return None


def served_drafter_problem(
    aux_layers: Sequence[int] | None, attention: str, options: Sequence[str], sglang_version: str | None
) -> str | None:
    """Why the drafter a profile describes cannot be served as exported, naming the profile's fields, or None.

    `aux_layers` (hidden.aux_layers, canonical; None: the target's default), `attention` (drafter.attention),
    `options` (the EAGLE 3.1 options the drafter turns on) and `sglang_version` (gpu_host.sglang_version; None:
    the export is written for every release that can serve it). Checked when the profile loads, before any
    training, with the rules the export applies after it (drafter.export.export_config)."""
    mla = attention == "mla"
    if mla and sglang_version and (why := mla_drafter_refusal(sglang_version)):
        return (
            f"drafter.attention: mla, but gpu_host.sglang_version: {why}; serve with SGLang >= 0.5.12 or set "
            "drafter.attention: gqa"
        )
    if aux_layers:
        # The targets are DeepSeek-V3 / Kimi-K2.5; a Llama target is checked again at export, from its config.
        # With EAGLE 3.1 options and no release named, the export writes ids for every release that reads the
        # options: the same rule here.
        versions = (
            [sglang_version]
            if sglang_version
            else mla_drafter_releases(options)
            if mla
            else [v for v, r in supported().items() if set(options) <= set(r.eagle31_options)]
            if options
            else None
        )
        try:
            draft_aux_ids(list(aux_layers), "deepseek", versions)
        except ValueError as e:
            span = f"{versions[0]} to {versions[-1]}" if versions else "none"
            why = (
                " (gpu_host.sglang_version)"
                if sglang_version
                else (
                    f" (drafter.{', drafter.'.join(options)} is EAGLE 3.1: the export writes aux ids that must be "
                    f"right on every SGLang release that reads it, {span}; or name the "
                    "release served in gpu_host.sglang_version)"
                    if options
                    else " (drafter.attention: mla: the export writes aux ids that must be right on every SGLang "
                    f"release that serves an MLA drafter, {span}; or name the release "
                    "served in gpu_host.sglang_version)"
                    if mla
                    else ""
                )
            )
            return f"hidden.aux_layers: {e}{why}"
    if options and sglang_version:  # refused before training, not at export after it
        served = release(sglang_version)
        if unread := [o for o in options if o not in served.drafter_options(attention)]:
            return (
                f"drafter.{', drafter.'.join(unread)}: gpu_host.sglang_version {served.version} does not read "
                "it from the draft config and would serve the drafter without it (SGLang "
                f">= {'0.5.13' if mla else '0.5.12'} does)"
            )
    return None
