"""The benchmark stage: acceptance length and speed of the exported drafter.

In-process (CPU profiles): the target and the drafter run in this process with
greedy verification, where every speculative output is asserted identical to plain
greedy decoding, and with speculative sampling at each of `bench.temperatures` above
0 (SGLang's lossless rejection rule, `bench.specdec`; the trained drafter and no
speculation only, to keep the demo's time; the untrained drafter in one round, for its acceptance). Served (GPU host): SGLang is started with and without the
drafter for each configuration and measured through its native API. Both
compare against no speculation, the n-gram drafter and an untrained drafter of
the same shape, and against the previous report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_dagster.config import BenchConfig
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from eagle3_dagster.storage import read_json
from eagle3_dagster.stages import Progress, StageReport, no_progress
from eagle3_dagster.stages import TARGET_FILES_RUN_WITH, StageSettings, TargetFiles, group, setting
from eagle3_dagster.target import TargetFacts, target_facts_at


@dataclass(frozen=True)
class BenchSettings(StageSettings):
    """benchmark_report: which prompts, how they are decoded and measured, and the server that serves them."""

    bench: BenchConfig = setting("bench")
    heldout_fraction: float = setting("data.heldout_fraction")  # the held-out prompts are the data split's
    max_seq_len: int = setting("data.max_seq_len")  # acceptance is split at the training length
    serving_context: int = setting("target.serving_context")  # prompts are capped to fit it
    # the release that serves the drafter, and reads another trainer's aux ids
    sglang_version: str | None = setting("gpu_host.sglang_version")
    aux_layers: list[int] | None = setting("hidden.aux_layers")  # the layers the served drafter is fed
    target: TargetFiles = group(runs_with=TARGET_FILES_RUN_WITH)
    sglang_port: int = setting("hidden.sglang_port", runs_with="where the server listens")
    sglang_server_args: list[str] = setting(
        "hidden.sglang_server_args",
        runs_with="the host's own server options (its device, memory fraction, attention backend)",
    )
    tp_size: int = setting("hidden.tp_size", runs_with="how many GPUs serve the target; the verify steps are the same")

    def target_facts(self, layout: ArtifactLayout) -> TargetFacts:
        return target_facts_at(self.target.model_dir(layout), self.aux_layers)


def benchmark_stage(
    settings: BenchSettings,
    layout: ArtifactLayout,
    *,
    export_dir: Path,
    previous_results: str | None,
    run_id: str,
    gpu_host: Any = None,
    progress: Progress = no_progress,
    out_dir: Path | None = None,
) -> StageReport:
    """Benchmark the drafter exported in `export_dir`: the path drafter_checkpoint's materialization names,
    or any standard EAGLE-3 export for the profile's target (another trainer's: `drafter.imported`).

    Results go to `out_dir` (default the profile's bench folder).
    """
    from eagle3_dagster.bench.report import headline, render_report

    if settings.bench.mode == "served":
        results = _served(settings, layout, Path(export_dir), gpu_host, progress)
    else:
        results = _inprocess(settings, layout, Path(export_dir), progress)
    previous = read_json(previous_results) if previous_results and Path(previous_results).exists() else None
    markdown, results_json, pngs = render_report(results, previous)
    out = Path(out_dir) if out_dir is not None else layout.bench_dir
    results_path = out / f"results-{run_id}.json"
    atomic_write_json(results_path, results_json)
    atomic_write_text(out / "report.md", render_report(results, previous, embed_images=False)[0])
    for name, png in pngs.items():
        atomic_write_bytes(out / name, png)
    drafter_meta = {k: v for k, v in results_json.get("meta", {}).items() if k.startswith("drafter_")}
    return StageReport(
        metadata={"results_json": results_path, **headline(results_json["rows"]), **drafter_meta},
        markdown={"report": markdown},
    )


def _served(settings: BenchSettings, layout: ArtifactLayout, export: Path, host: Any, progress: Progress) -> dict:
    """SGLang with the exported drafter at each configuration, and without it, on the GPU host.

    The client runs on the host beside each server (`run_on_host`), so the code location may be
    another machine; prompts are capped so that prompt + max_new_tokens fits the serving context.
    """
    from eagle3_dagster.bench.prompts import load_prompt_set, render_prompts
    from eagle3_dagster.bench.report import attach_speedups, results_document
    from eagle3_dagster.bench.served import prompt_token_limit, run_on_host
    from eagle3_dagster.bench.specdec import SpecConfig
    from eagle3_dagster.target import load_tokenizer

    if host is None:
        raise ValueError("benchmark_report: the served benchmark (bench.mode 'served') needs the gpu_host resource")
    installed = _serving_release(settings, export, host)
    target = settings.target_facts(layout)
    tokenizer = load_tokenizer(
        target.path, trust_remote_code=settings.target.trust_remote_code, reviewed_code=settings.target.reviewed_code
    )
    context, bench = settings.serving_context, settings.bench
    limit = prompt_token_limit(context, bench.max_new_tokens, bench.max_prompt_tokens)
    sets, described = {}, {}
    for name in bench.sets:
        prompt_set = load_prompt_set(name, bench.num_prompts, bench.set_paths.get(name))
        sets[name] = render_prompts(tokenizer, prompt_set, limit)
        described[name] = prompt_set.describe() | {
            "num_prompts": len(sets[name]),
            "max_prompt_tokens": limit,
            "num_left_out_over_context": len(prompt_set.prompts) - len(sets[name]),
        }

    drafter_meta = _served_drafter_notes(settings, export, target, progress, installed)
    configs = [(None, "no_spec")] + [(SpecConfig.parse(tuple(c)), "eagle3") for c in bench.spec_configs]
    rows = []
    for spec, method in configs:
        server = serving_spec(
            settings, target.path, export, installed, spec, port=host.spec.server_port(settings.sglang_port)
        )
        rows += run_on_host(
            host,
            server,
            sets,
            method=method,
            spec=spec.label if spec else None,
            max_new_tokens=bench.max_new_tokens,
            concurrency=bench.concurrency,
            log=progress,
        )
    return results_document(
        attach_speedups(rows), "served", described, meta={"target_identity": target.identity, **drafter_meta}
    )


def serving_spec(
    settings: BenchSettings,
    target_path: Path,
    export: Path,
    installed: str | None,
    spec: Any,
    *,
    port: int | None = None,
) -> Any:
    """The served benchmark's server: the target, and with `spec` (a `SpecConfig`) the exported drafter under
    `--speculative-algorithm EAGLE3` at that configuration; the release's serving options come with `installed`.
    `port`: the serving host's (default `hidden.sglang_port`)."""
    from eagle3_dagster.sglang.server import ServerSpec

    extra: tuple[str, ...] = ()
    if spec is not None:
        if installed is not None:  # every launch of the drafter, not only the stage's, meets the release check
            _check_export_release(export, installed, "the serving host")
        extra = (
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(export),
            "--speculative-num-steps",
            str(spec.num_steps),
            "--speculative-eagle-topk",
            str(spec.topk),
            "--speculative-num-draft-tokens",
            str(spec.num_draft_tokens or spec.num_steps + 1),
        )
    # the host's own options (its device, memory fraction, attention backend) after the drafter's, as extraction
    # passes them: without them a host that needs them (a CPU host: --device cpu) cannot serve the benchmark
    return ServerSpec(
        model_path=str(target_path),
        port=port or settings.sglang_port,
        tp_size=settings.tp_size,
        context_length=settings.serving_context,
        extra_args=(*extra, *settings.sglang_server_args),
        sglang_version=installed,
        trust_remote_code=settings.target.trust_remote_code,
        reviewed_code=settings.target.reviewed_code,
    )


def _serving_release(settings: BenchSettings, export: Path, host: Any) -> str:
    """The SGLang release installed on the host, refused unless it is `gpu_host.sglang_version` (when set) and
    one the export's aux ids are right on (config.json `eagle3_dagster_sglang.releases`): releases read a draft
    config's ids differently, so another one would feed the drafter other layers than it was trained on."""
    installed = host.preflight(".", sglang_version=settings.sglang_version)["sglang_version"]
    _check_export_release(export, installed, host.where())
    return installed


def _check_export_release(export: Path, installed: str, where: str) -> None:
    import json

    right_on = (json.loads((export / "config.json").read_text()).get("eagle3_dagster_sglang") or {}).get("releases")
    if right_on is not None and installed not in right_on:
        raise ValueError(
            f"benchmark_report: {where} has SGLang {installed}, but the export {export} has aux ids right on "
            f"SGLang {', '.join(right_on)} only (config.json eagle3_dagster_sglang.releases): {installed} would "
            f"capture other layers for the drafter; install one of those there, or export again with "
            f"gpu_host.sglang_version: {installed}"
        )


def _served_drafter_notes(
    settings: BenchSettings, export: Path, target: Any, progress: Progress, installed: str | None = None
) -> dict:
    """What the serving release will capture for another trainer's export (SGLang reads the export itself)."""
    import json

    from eagle3_dagster.drafter.imported import REFERENCE_SGLANG, is_own_export, resolve_aux_layers
    from eagle3_dagster.target import target_summary

    if is_own_export(export):
        return {"drafter_source": "eagle3_dagster"}
    cfg = json.loads((export / "config.json").read_text())
    version = installed or settings.sglang_version or REFERENCE_SGLANG  # the release that will serve it
    aux, origin, notes = resolve_aux_layers(
        cfg, target_summary(target.path)["architecture"], target.num_layers, version
    )
    for note in notes:
        progress(f"drafter {export}: {note}")
    return {
        "drafter_source": "external",
        "drafter_aux_layers": aux,
        "drafter_aux_layers_from": origin,
        "drafter_notes": notes,
    }


def _inprocess(settings: BenchSettings, layout: ArtifactLayout, export: Path, progress: Progress) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3_dagster.bench.prompts import heldout_sharegpt, load_prompt_set, render_prompts
    from eagle3_dagster.bench.proposers import Eagle3Proposer, NgramProposer
    from eagle3_dagster.bench.report import LengthBands, results_document
    from eagle3_dagster.bench.served import prompt_token_limit
    from eagle3_dagster.bench.specdec import DEFAULT_ROUNDS, Proposer, SpecConfig, run_inprocess_benchmark
    from eagle3_dagster.drafter.imported import load_any_drafter
    from eagle3_dagster.drafter.model import Eagle3Drafter
    from eagle3_dagster.threads import stage_threads

    threads = stage_threads(load_aware=True)
    target = settings.target_facts(layout)
    tokenizer = AutoTokenizer.from_pretrained(target.path)
    model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    imported = load_any_drafter(export, target.path, sglang_version=settings.sglang_version)
    for note in imported.notes:
        progress(f"drafter {export}: {note}")
    drafter = imported.model.float()
    torch.manual_seed(0)
    untrained = (
        Eagle3Drafter(
            drafter.cfg, drafter.embed_tokens.weight.detach().clone(), drafter.d2t.clone(), drafter.t2d.clone()
        )
        .float()
        .eval()
    )
    # Prompts fit the serving context with room for the answer; acceptance is split at the training length.
    context, bench = settings.serving_context, settings.bench
    limit = prompt_token_limit(context, bench.max_new_tokens, bench.max_prompt_tokens)
    bands = LengthBands.for_training(settings.max_seq_len, context)
    sets, described = {}, {}
    for name in bench.sets:
        if name == "heldout_sharegpt":
            prompt_set = heldout_sharegpt(bench.num_prompts, settings.heldout_fraction)
        else:
            prompt_set = load_prompt_set(name, bench.num_prompts, bench.set_paths.get(name))
        sets[name] = render_prompts(tokenizer, prompt_set, limit)
        described[name] = prompt_set.describe() | {
            "num_prompts": len(sets[name]),
            "max_prompt_tokens": limit,
            "num_left_out_over_context": len(prompt_set.prompts) - len(sets[name]),
        }
    proposers: dict[str, Proposer] = {
        "eagle3": Eagle3Proposer(drafter, name="eagle3"),
        "eagle3_untrained": Eagle3Proposer(untrained, name="eagle3_untrained"),
        "ngram": NgramProposer(name="ngram", max_ngram=bench.ngram_max),
    }
    eos = [i for i in [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id] if i is not None]
    with torch.inference_mode():
        rows = run_inprocess_benchmark(
            model,
            sets,
            proposers,
            [SpecConfig.parse(tuple(c)) for c in bench.spec_configs],
            bench.max_new_tokens,
            eos_ids=set(eos),
            check=True,
            log=progress,
            rounds=DEFAULT_ROUNDS,
            bands=bands,
            temperatures=bench.temperatures,
            sampled_proposers={"eagle3"},
            # the untrained drafter is a control for acceptance (about 1.0); drafting k tokens that all fail, it
            # is the slowest method to run, and nobody compares its speed, so it runs in round 0 only
            timed_proposers={"eagle3", "ngram"},
        )
    return results_document(
        rows,
        "inprocess",
        described,
        meta={
            "target_identity": target.identity,
            "training_max_seq_len": settings.max_seq_len,
            "serving_context": context,
            "rounds": DEFAULT_ROUNDS,
            "temperatures": list(bench.temperatures),
            "torch_threads": threads,
            "sampling_rule": "SGLang tree_speculative_sampling_target_only (topk 1: one-hot draft), thresholds 1.0",
            **imported.metadata(),
        },
    )
