"""Every dataset kind the profile schema accepts, through every stage up to the plan, under exactly what its
asset gives it.

Each combination of `source` × `regenerate` × `generation.backend` runs raw_responses, tokenized_dataset,
merged_train, vocab_mapping and extraction_plan with the settings object each asset hands its stage
(`XSettings.from_profile`, whose content is what the asset's code version hashes): a stage reads only what
that object declares, so one that comes to use another setting fails here, not in a user's first production
run. (The production profile's `prompts_jsonl` datasets with a path once failed at raw_responses, on
data.bad_fraction_threshold, and `conversations_jsonl` with `regenerate: false` at tokenized_dataset, on
generation.max_new_tokens, when the declaration was a hand-kept list beside the stage.)
"""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest

from eagle3_dagster.config import load_profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.stages.data import MergeSettings, RegenerateSettings, TokenizeSettings, VocabSettings
from eagle3_dagster.stages.hidden import PlanSettings
from eagle3_dagster.io import iter_jsonl
from test_chat_client import SECRET, FakeOpenRouter

SOURCES = ("sharegpt", "prompts_jsonl", "conversations_jsonl", "pretokenized_jsonl")
COMBINATIONS = list(itertools.product(SOURCES, (True, False), ("local", "openai")))
N = 6  # conversations per dataset


def _source_file(tmp_path: Path, source: str, tokenizer) -> str | None:
    """The first ShareGPT exchanges (the micro target's pre-training data, which it answers within the length
    limit more often than not) as a file of the source's kind."""
    from eagle3_dagster.data.sharegpt import ShareGPTReader

    if source == "sharegpt":
        return None
    path = tmp_path / f"{source}.jsonl"
    lines = []
    for conv in ShareGPTReader(split="train"):
        messages = [dict(m) for m in conv.messages[:2]]
        if len(tokenizer.encode(messages[0]["content"])) > 48:  # room for the answer in data.max_seq_len
            continue
        if len(lines) == N:
            break
        i = len(lines)
        if source == "pretokenized_jsonl":
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            prompt = tokenizer.apply_chat_template(
                messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            lines.append(
                orjson.dumps(
                    {
                        "id": f"t{i}",
                        "input_ids": list(ids),
                        "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt)),
                    }
                )
            )
        else:
            lines.append(orjson.dumps({"id": f"c{i}", "messages": messages}))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.mark.parametrize(
    "source,regenerate,backend", COMBINATIONS, ids=[f"{s}-{'regen' if r else 'as_is'}-{b}" for s, r, b in COMBINATIONS]
)
def test_every_dataset_kind_runs_every_stage_to_the_plan_under_what_its_asset_gives_it(
    tmp_path, micro_target, source, regenerate, backend
) -> None:
    from eagle3_dagster.stages.data import build_vocab, merge_partitions, regenerate_partition, tokenize_partition
    from eagle3_dagster.stages.hidden import plan_stage
    from eagle3_dagster.target import load_tokenizer

    path = _source_file(tmp_path, source, load_tokenizer(micro_target, trust_remote_code=False))
    dataset = {
        "name": "d",
        "source": source,
        "regenerate": regenerate,
        "max_conversations": N,
        "max_turns": 1,
        **({"path": path} if path else {}),
    }
    with FakeOpenRouter() as server:
        generation = {"backend": backend, "max_new_tokens": 96, "concurrency": 3}
        if backend == "openai":
            generation |= {"base_url": server.url, "model": "m", "timeout_s": 5}
        profile = load_profile(
            "micro",
            overrides={
                "run_root": str(tmp_path / "run"),
                "target": {"kind": "external", "path": str(micro_target)},
                "datasets": [dataset],
                "hidden": {"root": str(tmp_path / "run" / "hidden_states")},
                "generation": generation,
                "data": {"heldout_fraction": 0.0, "draft_vocab_size": 64},
            },
        )
        layout = ArtifactLayout.from_profile(profile)
        raw = regenerate_partition(RegenerateSettings.from_profile(profile), "d", layout, api_key=SECRET).metadata
        regenerated = regenerate and source != "pretokenized_jsonl"
        assert raw.get("regenerated", True) is regenerated
        assert len(server.received) == (N if regenerated and backend == "openai" else 0)
    tokenized = tokenize_partition(TokenizeSettings.from_profile(profile), "d", layout).metadata
    assert tokenized["num_inputs"] == N and tokenized["num_quarantined"] == 0
    # the tiny target runs past the length limit on some prompts: those answers are dropped and counted
    cut = tokenized["num_dropped_length"] if regenerated and backend == "local" else 0
    assert tokenized["num_records"] == N - cut > 0
    merged = merge_partitions(MergeSettings.from_profile(profile), layout).metadata
    assert merged["num_records"] == N - cut
    build_vocab(VocabSettings.from_profile(profile), layout)
    records = list(iter_jsonl(layout.merged_train))
    assert all(sum(r["loss_mask"]) > 0 for r in records)
    plan, fits, _ = plan_stage(PlanSettings.from_profile(profile), layout, free_bytes=None)
    assert fits and plan.metadata["num_samples"] == N - cut


def test_a_finished_conversation_keeps_the_generation_length_for_its_answer(tmp_path, micro_target) -> None:
    """A dataset used as it is generates nothing: its turns are fitted to data.max_seq_len alone, not to
    max_seq_len − generation.max_new_tokens (which would drop every turn whose prompt is longer than the
    room left after an answer that is never generated)."""
    from eagle3_dagster.stages.data import tokenize_partition
    from eagle3_dagster.target import load_tokenizer

    tokenizer = load_tokenizer(micro_target, trust_remote_code=False)
    question = "Tell me about the river " * 12
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "It flows."}]
    prompt_len = len(
        tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    path = tmp_path / "c.jsonl"
    path.write_bytes(orjson.dumps({"id": "c0", "messages": messages}) + b"\n")
    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "target": {"kind": "external", "path": str(micro_target)},
            "datasets": [{"name": "c", "source": "conversations_jsonl", "path": str(path), "regenerate": False}],
            "hidden": {"root": str(tmp_path / "run" / "hidden_states")},
            # the prompt fits the sequence length, but not beside a generation budget nothing will use
            "data": {"max_seq_len": prompt_len + 16},
            "generation": {"max_new_tokens": 64},
        },
    )
    meta = tokenize_partition(
        TokenizeSettings.from_profile(profile), "c", ArtifactLayout.from_profile(profile)
    ).metadata
    assert meta["num_records"] == 1
