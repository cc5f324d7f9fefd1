"""The stage functions the assets call, run in-process on the micro target: one corpus walked from
conversations to a benchmark report (tokenize → merge → vocab → export → finish_training → benchmark).

Each test checks what the stage hands on (the file the next stage reads, the metadata the UI shows) and
how it refuses bad input, against figures the test computes from the files, not from the stage's report.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_dagster.config import load_profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.io import iter_jsonl, sha256_file
from eagle3_dagster.stages.bench import BenchSettings
from eagle3_dagster.stages.data import MergeSettings, TokenizeSettings, VocabSettings
from eagle3_dagster.stages.hidden import ExtractSettings, PlanSettings
from eagle3_dagster.stages.train import TrainSettings

# eagle3_dagster.progress: "label: done/total unit (pct), rate unit/s, ETA h:mm:ss"
PROGRESS = re.compile(r"^(\S+): ([\d,]+)/([\d,]+) (\w+) \((\d+\.\d)%\), ([\d.,]+) \4/s, ETA \d+:\d\d:\d\d")
REPLIES = ["The capital of France is Paris.", "Two plus two is four.", "Water boils at one hundred degrees."]


def _conversations(path: Path, n: int, *, bad_lines: int = 0) -> Path:
    lines = []
    for i in range(n):
        lines.append(
            orjson.dumps(
                {
                    "id": f"c{i}",
                    "messages": [
                        {"role": "user", "content": f"Question number {i}?"},
                        {"role": "assistant", "content": REPLIES[i % len(REPLIES)]},
                    ],
                }
            )
        )
    lines += [b'{"id": "broken", "messages": [{"role": "user"'] * bad_lines  # cut off mid-record
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _profile(tmp_path: Path, target: Path, datasets: list[dict], **overrides):
    return load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "target": {"kind": "external", "path": str(target)},
            "datasets": datasets,
            "hidden": {"root": str(tmp_path / "run" / "hidden_states")},
            **overrides,
        },
    )


def _two_partitions(tmp_path: Path, target: Path, **overrides):
    datasets = [
        {
            "name": "a",
            "source": "conversations_jsonl",
            "regenerate": False,
            "path": str(_conversations(tmp_path / "a.jsonl", 9, bad_lines=1)),
        },
        {
            "name": "b",
            "source": "conversations_jsonl",
            "regenerate": False,
            "path": str(_conversations(tmp_path / "b.jsonl", 5)),
        },
    ]
    profile = _profile(
        tmp_path,
        target,
        datasets,
        data={"bad_fraction_threshold": 0.2, "max_seq_len": 192, "draft_vocab_size": 64},
        **overrides,
    )
    return profile, ArtifactLayout.from_profile(profile)


def _merged_corpus(tmp_path: Path, target: Path, *, vocab: bool = True, **overrides):
    """Both partitions tokenized and merged (and the vocab mapping built): what the later stages read."""
    from eagle3_dagster.stages.data import build_vocab, merge_partitions, tokenize_partition

    profile, layout = _two_partitions(tmp_path, target, **overrides)
    for name in ("a", "b"):
        tokenize_partition(TokenizeSettings.from_profile(profile), name, layout)
    merge_partitions(MergeSettings.from_profile(profile), layout)
    if vocab:
        build_vocab(VocabSettings.from_profile(profile), layout)
    return profile, layout


def test_tokenize_partition_writes_the_records_and_counts_the_quarantine(tmp_path, micro_target):
    from eagle3_dagster.stages.data import tokenize_partition
    from eagle3_dagster.target import load_tokenizer

    profile, layout = _two_partitions(tmp_path, micro_target)
    lines: list[str] = []
    report = tokenize_partition(TokenizeSettings.from_profile(profile), "a", layout, progress=lines.append)
    meta = report.metadata
    assert meta["path"] == layout.tokenized("a") and meta["quarantine_path"] == layout.quarantine("a")
    records = list(iter_jsonl(layout.tokenized("a")))
    assert [r["id"] for r in records] == [f"a/c{i}/0" for i in range(9)]  # one record per assistant turn
    assert meta["num_records"] == 9 and meta["num_quarantined"] == 1
    assert meta["num_tokens"] == sum(len(r["input_ids"]) for r in records)
    quarantined = [orjson.loads(line) for line in layout.quarantine("a").read_bytes().splitlines()]
    assert len(quarantined) == 1 and quarantined[0]["reason"].startswith("not_json")
    tokenizer = load_tokenizer(micro_target, trust_remote_code=False)
    for i, r in enumerate(records):  # the supervised tokens are the assistant's reply, and only it
        supervised = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
        assert REPLIES[i % len(REPLIES)] in tokenizer.decode(supervised)
        assert f"Question number {i}" not in tokenizer.decode(supervised)
    assert any("tokenized a: 9 records" in line for line in lines)


def test_tokenize_partition_with_no_usable_record_fails_naming_the_quarantine(tmp_path, micro_target):
    from eagle3_dagster.stages.data import tokenize_partition

    path = tmp_path / "bad.jsonl"
    path.write_bytes(orjson.dumps({"id": "x", "input_ids": [1, 2, 10**6], "loss_mask": [0, 1, 1]}) + b"\n")
    profile = _profile(
        tmp_path,
        micro_target,
        [{"name": "p", "source": "pretokenized_jsonl", "path": str(path)}],
        data={"bad_fraction_threshold": 1.0},
    )
    layout = ArtifactLayout.from_profile(profile)
    with pytest.raises(ValueError, match=r"tokenized_dataset\[p\]: no usable record out of 1 inputs") as err:
        tokenize_partition(TokenizeSettings.from_profile(profile), "p", layout)
    assert str(layout.quarantine("p")) in str(err.value)
    assert "input_ids outside [0, 512)" in layout.quarantine("p").read_text()


def test_merge_partitions_shuffles_every_record_once_and_names_a_missing_partition(tmp_path, micro_target):
    from eagle3_dagster.stages.data import merge_partitions, tokenize_partition

    profile, layout = _two_partitions(tmp_path, micro_target)
    tokenize_partition(TokenizeSettings.from_profile(profile), "a", layout)
    with pytest.raises(FileNotFoundError, match=r"not materialized: b \("):
        merge_partitions(MergeSettings.from_profile(profile), layout)
    tokenize_partition(TokenizeSettings.from_profile(profile), "b", layout)
    report = merge_partitions(MergeSettings.from_profile(profile), layout)
    merged = list(iter_jsonl(layout.merged_train))
    inputs = [r for name in ("a", "b") for r in iter_jsonl(layout.tokenized(name))]
    assert sorted(r["id"] for r in merged) == sorted(r["id"] for r in inputs)
    assert [r["id"] for r in merged] != [r["id"] for r in inputs]  # shuffled
    by_id = {r["id"]: r for r in inputs}
    assert all(r["input_ids"] == by_id[r["id"]]["input_ids"] for r in merged)
    meta = report.metadata
    assert meta["sha256"] == sha256_file(layout.merged_train) == report.data_version
    assert meta["num_shards"] == math.ceil(len(merged) / profile.hidden.samples_per_shard)
    assert Path(report.images["sequence_lengths"]).stat().st_size > 0
    bars, _ = report.series["records_by_length"]
    assert sum(bars) == len(merged) and len(bars) == 48

    dropped = profile.model_copy(update={"data": profile.data.model_copy(update={"drop_datasets": ["b"]})})
    merge_partitions(MergeSettings.from_profile(dropped), layout)
    assert sorted(r["id"] for r in iter_jsonl(layout.merged_train)) == sorted(
        r["id"] for r in iter_jsonl(layout.tokenized("a"))
    )


def test_build_vocab_keeps_the_most_frequent_supervised_tokens(tmp_path, micro_target):
    from eagle3_dagster.stages.data import build_vocab

    profile, layout = _merged_corpus(tmp_path, micro_target, vocab=False)
    report = build_vocab(VocabSettings.from_profile(profile), layout)
    mapping = load_file(str(report.metadata["path"]))
    t2d, d2t = mapping["t2d"], mapping["d2t"]
    assert t2d.shape == (512,) and int(t2d.sum()) == d2t.shape[0] == 64
    counts = Counter(t for r in iter_jsonl(layout.merged_train) for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    kept = set(t2d.nonzero().squeeze(-1).tolist())
    assert kept >= {t for t, _ in counts.most_common(min(len(counts), 64)) if counts[t] > 1}
    assert torch.equal(torch.arange(64) + d2t, t2d.nonzero().squeeze(-1))  # SGLang maps draft id i to i + d2t[i]


def _export_for(profile, layout, out_dir: Path, *, poison: bool = False, drop: str | None = None) -> Path:
    """An untrained drafter of the micro target's shape over the corpus's vocab mapping, exported as training does;
    `poison`: with a NaN in fc.weight, `drop`: without that weight."""
    from eagle3_dagster.drafter.export import export_drafter
    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_dagster.drafter.target_head import load_target_tensors

    target = load_target_tensors(Path(profile.target.path), want=("embed",))
    mapping = load_file(str(layout.vocab_mapping))
    a = target.arch
    cfg = DrafterConfig.for_target(
        target_hidden_size=a.hidden_size,
        target_intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        draft_vocab_size=int(mapping["d2t"].shape[0]),
        aux_layers=(1, 2, 3),
        rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=profile.target.serving_context,
    )
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, target.embed.float(), mapping["d2t"], mapping["t2d"])
    out = export_drafter(drafter, out_dir / "export", profile.target.serving_context, torch.float32)
    if poison or drop:
        weights = load_file(str(out / "model.safetensors"))
        if poison:
            weights["fc.weight"][0, 0] = float("nan")
        weights.pop(drop or "", None)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _finished_run(profile, layout, name: str, *, poison: bool = False, drop: str | None = None):
    from eagle3_dagster.io import atomic_write_json
    from eagle3_dagster.stages.train import TrainLaunch
    from eagle3_dagster.train.outputs import plot_curves

    out_dir = layout.drafter_dir / name
    _export_for(profile, layout, out_dir, poison=poison, drop=drop)
    curves = {
        "step": [1, 2],
        "loss": [4.0, 3.5],
        "lr": [1e-3, 1e-3],
        "acc_0": [0.1, 0.2],
        "acc_1": [0.05, 0.1],
        "acc_2": [0.0, 0.05],
        "loss_0": [4, 3.5],
        "loss_1": [4, 3.6],
        "loss_2": [4, 3.7],
    }
    final = {"acc_0": 0.212345678, "acc_1": 0.1, "acc_2": 0.05, "sim_accept_length": 1.2334567, "loss": 3.512345678}
    final_eval = final | {"scope": "heldout", "num_samples": 7, "num_scored_tokens": 123}
    atomic_write_json(
        out_dir / "metrics.json",
        {
            "steps": 2,
            "tokens_per_s": 1234.5678,
            "initial_eval": {"acc_0": 0.01},
            "final": final,
            "final_eval": final_eval,
            "curves": curves,
        },
    )
    plot_curves(curves, out_dir / "curves.png", 3)
    return TrainLaunch(command=[], env={}, cwd=".", job_path=out_dir / "job.json", out_dir=out_dir)


def test_finish_training_hands_on_a_checked_export_and_refuses_a_non_finite_or_incomplete_one(tmp_path, micro_target):
    from eagle3_dagster.stages.train import finish_training

    profile, layout = _merged_corpus(tmp_path, micro_target, train={"export_location": str(tmp_path / "published")})

    report, ok, _ = finish_training(
        TrainSettings.from_profile(profile), layout, _finished_run(profile, layout, "run-good")
    )
    meta = report.metadata
    assert ok and meta["export_dir"] == layout.drafter_dir / "run-good" / "export"
    # every figure is named for what it was measured on: the held-out samples, or the last training step
    assert (meta["heldout_loss"], meta["heldout_acc_0"], meta["heldout_sim_accept_length"], meta["tokens_per_s"]) == (
        3.51235,
        0.2123,
        1.2335,
        1234.6,
    )
    assert (meta["eval_scope"], meta["heldout_samples"], meta["heldout_scored_tokens"]) == ("heldout", 7, 123)
    assert meta["last_step_train_loss"] == 3.5 and meta["untrained_acc_0"] == 0.01
    assert not {"final_loss", "acc_0", "sim_accept_length"} & set(meta)
    assert report.series["loss_by_step"] == ([4.0, 3.5], "training step")  # the run's curves, inline in the UI
    published = Path(meta["export_location"])
    assert sha256_file(published / "model.safetensors") == sha256_file(meta["export_dir"] / "model.safetensors")

    # a failing export is the failed check's to report: named only as refused, never as the export, nor published
    for run, bad in [("run-nan", {"poison": True}), ("run-incomplete", {"drop": "midlayer.mlp.down_proj.weight"})]:
        report, ok, detail = finish_training(
            TrainSettings.from_profile(profile), layout, _finished_run(profile, layout, run, **bad)
        )
        assert not ok and re.search(rf"export in .*{run}/export is refused.*(fc|down_proj).weight", detail)
        assert report.metadata["refused_export_dir"] == layout.drafter_dir / run / "export"
        assert not {"export_dir", "export_location"} & set(report.metadata)
        assert not (tmp_path / "published" / run).exists()


@pytest.mark.slow  # speculative decoding of the micro target, twice
def test_benchmark_stage_in_process_writes_results_and_compares_with_the_previous_report(tmp_path, micro_target):
    from eagle3_dagster.stages.bench import benchmark_stage

    profile, layout = _merged_corpus(
        tmp_path,
        micro_target,
        bench={"spec_configs": [[2, 1, 3]], "num_prompts": 2, "max_new_tokens": 8, "sets": ["heldout_sharegpt"]},
    )
    export = _export_for(profile, layout, tmp_path / "drafter")

    lines: list[str] = []
    first = benchmark_stage(
        BenchSettings.from_profile(profile),
        layout,
        export_dir=export,
        previous_results=None,
        run_id="r1",
        progress=lines.append,
    )
    results = orjson.loads(Path(first.metadata["results_json"]).read_bytes())
    rows = {r["method"]: r for r in results["rows"]}
    assert set(rows) == {"no_spec", "eagle3", "eagle3_untrained", "ngram"}
    # speculation never changes the greedy output: every method generates the same tokens for the 2 prompts
    assert {(r["num_prompts"], r["completion_tokens"]) for r in rows.values()} == {
        (2, rows["no_spec"]["completion_tokens"])
    }
    assert 0 < rows["no_spec"]["completion_tokens"] <= 2 * 8
    # the untrained control runs once, for its acceptance; the methods a reader compares are timed in every round
    assert (
        rows["eagle3_untrained"]["timed_rounds"] == 1
        and rows["eagle3"]["timed_rounds"] == results["meta"]["rounds"] > 1
    )
    assert "Controls run once, for their acceptance" in (layout.bench_dir / "report.md").read_text()
    trained_band = next(b for b in rows["eagle3"]["bands"] if b["training_band"])
    assert first.metadata["headline_config"] == (
        f"eagle3 at 2,1,3 on heldout_sharegpt, prompts of {trained_band['band']} tokens (the training length)"
    )
    assert first.metadata["acceptance_length"] == round(trained_band["acceptance_length"], 4)
    assert (layout.bench_dir / "report.md").exists()
    progress = [m for m in map(PROGRESS.match, lines) if m]  # within each method, by the shared contract
    assert progress and progress[-1].group(2) == progress[-1].group(3), lines

    second = benchmark_stage(
        BenchSettings.from_profile(profile),
        layout,
        export_dir=export,
        previous_results=str(first.metadata["results_json"]),
        run_id="r2",
    )
    compared = second.markdown["report"].split("## Compared with the previous run")[1]
    assert "| heldout_sharegpt | eagle3 | 2,1,3 | acceptance_length |" in compared
    assert Path(second.metadata["results_json"]).name == "results-r2.json"


def test_a_partition_key_added_by_hand_is_refused_before_any_extraction(tmp_path, micro_target):
    """The UI's "Add partition" cannot be hidden (Dagster 1.13): such a key's run names the plan's shards."""
    from eagle3_dagster.hidden.extraction_plan import build_plan, write_plan
    from eagle3_dagster.stages.hidden import extract_stage

    profile, layout = _merged_corpus(tmp_path, micro_target, vocab=False)
    plan = build_plan(profile, layout)
    plan_path = write_plan(plan)
    with pytest.raises(KeyError, match=r"partitions \['my-shard'\] are not shards of the plan .*\(4 shards\)"):
        extract_stage(ExtractSettings.from_profile(profile), plan_path, ["shard-00000", "my-shard"])
    assert not [p for p in Path(plan.version_dir).iterdir() if p.name != "plan.json"]  # nothing extracted


def test_the_plan_says_how_many_optimizer_steps_training_makes_of_the_corpus(tmp_path, micro_target):
    from eagle3_dagster.hidden.extraction_plan import build_plan
    from eagle3_dagster.stages.hidden import plan_stage
    from eagle3_dagster.train.schedule import TrainSchedule, is_heldout_sample, plan_epoch

    profile, layout = _merged_corpus(
        tmp_path, micro_target, train={"batch_tokens": 128, "epochs": 3, "eval_fraction": 0.1}
    )
    report, _, _ = plan_stage(PlanSettings.from_profile(profile), layout, free_bytes=None)
    schedule = TrainSchedule(**report.metadata["train_schedule"])
    shards = build_plan(profile, layout).shards
    kept = [n for s in shards for sid, n in zip(s.sample_ids, s.lengths) if not is_heldout_sample(sid, 0.1)]
    batches = plan_epoch(kept, 128, profile.train.seed, 0, profile.train.nproc_per_node)
    assert schedule.num_train_samples == len(kept)
    assert schedule.num_train_samples + schedule.num_heldout_samples == sum(len(s.sample_ids) for s in shards)
    assert schedule.steps_per_epoch == len(batches) // profile.train.nproc_per_node
    assert schedule.total_steps == 3 * schedule.steps_per_epoch > 0
    assert f"{schedule.total_steps:,} optimizer steps" in schedule.describe()
