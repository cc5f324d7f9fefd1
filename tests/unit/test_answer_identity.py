"""Every stored answer carries who produced it (target or served model, and the tokenizer); an answer of
another producer is neither reused by raw_responses nor tokenized, and both stages say how many they set
aside and why. Run on a copy of the micro target whose tokenizer is then replaced (ids permuted, same
vocabulary size: the check that ids are in range cannot see it)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import orjson
import pytest

from eagle3_dagster.config import load_profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.generate.store import iter_turns
from eagle3_dagster.io import iter_jsonl
from eagle3_dagster.target import target_identity, tokenizer_identity
from test_chat_client import SECRET, FakeOpenRouter
from eagle3_dagster.stages.data import RegenerateSettings, TokenizeSettings


def _permute_token_ids(model_dir: Path, seed: int = 0) -> None:
    """The same tokens and vocabulary size with the ordinary tokens' ids shuffled (special ones kept)."""
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    special = {t["id"] for t in data["added_tokens"]}
    regular = sorted(i for i in vocab.values() if i not in special)
    shuffled = list(regular)
    random.Random(seed).shuffle(shuffled)
    mapping = dict(zip(regular, shuffled))
    data["model"]["vocab"] = {token: mapping.get(i, i) for token, i in vocab.items()}
    path.write_text(json.dumps(data))


def _setup(tmp_path: Path, micro_target: Path, generation: dict | None = None):
    target = tmp_path / "target"
    shutil.copytree(micro_target, target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(
        b"".join(orjson.dumps({"id": f"p{i}", "prompt": f"Tell me about topic {i}."}) + b"\n" for i in range(4))
    )
    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "target": {"kind": "external", "path": str(target)},
            "datasets": [{"name": "p", "source": "prompts_jsonl", "path": str(prompts)}],
            "hidden": {"root": str(tmp_path / "run" / "hidden_states")},
            "generation": {"backend": "local", "max_new_tokens": 8, **(generation or {})},
        },
    )
    return profile, ArtifactLayout.from_profile(profile), target


def test_a_replaced_tokenizer_never_reuses_nor_tokenizes_the_answers_of_the_old_one(tmp_path, micro_target):
    from eagle3_dagster.data.tokenize import tokenize_regenerated
    from eagle3_dagster.stages.data import answer_producer_of, regenerate_partition
    from eagle3_dagster.stages import TargetFiles
    from eagle3_dagster.target import load_tokenizer

    profile, layout, target = _setup(tmp_path, micro_target)
    first = regenerate_partition(RegenerateSettings.from_profile(profile), "p", layout, api_key=None).metadata
    assert first["num_requests"] == 4 and first["num_turns_set_aside"] == 0
    old_turns = list(iter_turns(layout.raw_responses("p")))
    assert all(
        t["producer"]
        == {"backend": "local", "target": target_identity(target), "tokenizer": tokenizer_identity(target)}
        for t in old_turns
    )

    _permute_token_ids(target)
    second = regenerate_partition(RegenerateSettings.from_profile(profile), "p", layout, api_key=None).metadata
    assert second["num_requests"] == 4 and second["num_turns_reused"] == 0
    assert second["num_turns_set_aside"] == 4 and second["set_aside_by_reason"] == {"another tokenizer": 4}

    # tokenized with the new tokenizer: only the new answers (the old ones' ids would be other tokens now);
    # how many of them were cut off depends on the model, so the engine's counts are read, not the stage's
    stats = tokenize_regenerated(
        layout.raw_responses("p"),
        load_tokenizer(target, trust_remote_code=False),
        tmp_path / "tokenized.jsonl",
        tmp_path / "quarantine.jsonl",
        dataset="p",
        producer=answer_producer_of(
            profile.generation.backend, profile.generation.model, TargetFiles.from_profile(profile), layout
        ),
    )
    assert stats.num_inputs == 4 and stats.num_quarantined == 0
    assert stats.num_set_aside == 4 and stats.set_aside_by_reason == {"another tokenizer": 4}
    assert stats.num_records + stats.num_dropped_length == 4
    new_turns = {
        t["request_id"]: t
        for t in iter_turns(layout.raw_responses("p"))
        if t["producer"]["tokenizer"] == tokenizer_identity(target)
    }
    assert len(new_turns) == 4 and not set(new_turns) & {t["request_id"] for t in old_turns}
    for record in iter_jsonl(tmp_path / "tokenized.jsonl"):
        supervised = [t for t, m in zip(record["input_ids"], record["loss_mask"]) if m]
        assert supervised == new_turns[record["request_id"]]["response"]["completion_ids"]


def test_an_api_answer_is_reused_only_under_the_same_served_model_and_tokenizer(tmp_path, micro_target):
    from eagle3_dagster.stages.data import regenerate_partition, tokenize_partition

    with FakeOpenRouter() as server:
        profile, layout, target = _setup(
            tmp_path,
            micro_target,
            {"backend": "openai", "base_url": server.url, "model": "moonshotai/kimi-k2.5", "timeout_s": 5},
        )
        first = regenerate_partition(RegenerateSettings.from_profile(profile), "p", layout, api_key=SECRET).metadata
        again = regenerate_partition(RegenerateSettings.from_profile(profile), "p", layout, api_key=SECRET).metadata
        assert first["num_requests"] == 4 and again["num_requests"] == 0
        assert again["num_conversations_already_complete"] == 4  # same model and tokenizer: reused
        (target / "chat_template.jinja").write_text((target / "chat_template.jinja").read_text() + "\n")
        changed = regenerate_partition(RegenerateSettings.from_profile(profile), "p", layout, api_key=SECRET).metadata
    assert changed["num_requests"] == 4 and changed["set_aside_by_reason"] == {"another tokenizer": 4}
    turns = list(iter_turns(layout.raw_responses("p")))
    assert turns[-1]["producer"] == {
        "backend": "openai",
        "model": "moonshotai/kimi-k2.5",
        "tokenizer": tokenizer_identity(target),
    }
    report = tokenize_partition(TokenizeSettings.from_profile(profile), "p", layout).metadata
    assert report["num_records"] == 4 and report["num_set_aside"] == 4


def test_answers_written_before_answers_carried_a_producer_are_set_aside(tmp_path, micro_target):
    from eagle3_dagster.stages.data import tokenize_partition

    profile, layout, target = _setup(tmp_path, micro_target)
    store = layout.raw_responses("p")
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_bytes(
        orjson.dumps(
            {
                "type": "turn",
                "request_id": "r0",
                "dataset": "p",
                "conversation_id": "p0",
                "turn": 0,
                "messages": [{"role": "user", "content": "hi"}],
                "usage": {},
                "cost_usd": 0.0,
                "response": {"reasoning": "", "content": "hello", "tool_calls": [], "finish_reason": "stop"},
            }
        )
        + b"\n"
    )
    with pytest.raises(ValueError, match="no usable record") as err:
        tokenize_partition(TokenizeSettings.from_profile(profile), "p", layout)
    message = str(err.value)
    assert "1 recorded turns were set aside" in message and "no producer recorded" in message
    assert "materialize raw_responses[p] again" in message
