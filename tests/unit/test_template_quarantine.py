"""A chat template that raises on one conversation quarantines that conversation (its id and the template's
message), and the rest of the dataset goes on; the quarantined ones count toward data.bad_fraction_threshold.
A copy of the micro target whose template raises on a marker word, as a real template raises on input it
does not support."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest

from eagle3_dagster.config import load_profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.data.tokenize import BadDataError
from test_chat_client import SECRET, FakeOpenRouter
from eagle3_dagster.stages.data import RegenerateSettings, TokenizeSettings

POISON = (
    "{%- for m in messages -%}{%- if m.get('content') is string and 'POISON' in m['content'] -%}"
    "{{ raise_exception('this template cannot render POISON') }}{%- endif -%}{%- endfor -%}"
)


def _target(tmp_path: Path, micro_target: Path) -> Path:
    target = tmp_path / "target"
    shutil.copytree(micro_target, target)
    template = target / "chat_template.jinja"
    template.write_text(POISON + template.read_text())
    return target


def _records(path: Path, n: int, poisoned: set[int], *, answers: bool) -> Path:
    lines = []
    for i in range(n):
        question = f"Question {i} POISON?" if i in poisoned else f"Question {i}?"
        record = {"id": f"c{i}", "messages": [{"role": "user", "content": question}]}
        if answers:
            record["messages"].append({"role": "assistant", "content": f"Answer {i}."})
        lines.append(orjson.dumps(record))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _profile(tmp_path: Path, target: Path, dataset: dict, **generation):
    return load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "target": {"kind": "external", "path": str(target)},
            "datasets": [dataset],
            "hidden": {"root": str(tmp_path / "run" / "hidden_states")},
            "generation": {"max_new_tokens": 8, **generation},
        },
    )


def test_finished_conversations_one_of_which_the_template_cannot_render(tmp_path, micro_target):
    from eagle3_dagster.stages.data import tokenize_partition

    target = _target(tmp_path, micro_target)
    path = _records(tmp_path / "convs.jsonl", 40, {7}, answers=True)
    profile = _profile(
        tmp_path, target, {"name": "c", "source": "conversations_jsonl", "path": str(path), "regenerate": False}
    )
    layout = ArtifactLayout.from_profile(profile)
    meta = tokenize_partition(TokenizeSettings.from_profile(profile), "c", layout).metadata
    assert meta["num_records"] == 39 and meta["num_quarantined"] == 1
    (bad,) = [orjson.loads(line) for line in layout.quarantine("c").read_bytes().splitlines()]
    assert "c7" in bad["where"] and "this template cannot render POISON" in bad["reason"]


def test_regenerated_prompts_one_of_which_the_template_cannot_render(tmp_path, micro_target):
    from eagle3_dagster.stages.data import regenerate_partition, tokenize_partition

    target = _target(tmp_path, micro_target)
    path = _records(tmp_path / "prompts.jsonl", 40, {3}, answers=False)
    with FakeOpenRouter() as server:
        profile = _profile(
            tmp_path,
            target,
            {"name": "p", "source": "prompts_jsonl", "path": str(path)},
            backend="openai",
            base_url=server.url,
            model="m",
            timeout_s=5,
        )
        layout = ArtifactLayout.from_profile(profile)
        raw = regenerate_partition(RegenerateSettings.from_profile(profile), "p", layout, api_key=SECRET).metadata
        assert len(server.received) == 39
    assert raw["num_conversations_quarantined_chat_template"] == 1
    meta = tokenize_partition(TokenizeSettings.from_profile(profile), "p", layout).metadata
    assert meta["num_records"] == 39 and meta["num_quarantined"] == 1 and meta["num_inputs"] == 40
    (bad,) = [orjson.loads(line) for line in layout.quarantine("p").read_bytes().splitlines()]
    assert "conversation c3" in bad["where"] and "this template cannot render POISON" in bad["reason"]


def test_more_unrenderable_conversations_than_the_threshold_fail_the_dataset_naming_the_reason(tmp_path, micro_target):
    from eagle3_dagster.stages.data import tokenize_partition

    target = _target(tmp_path, micro_target)
    path = _records(tmp_path / "convs.jsonl", 40, {1, 2, 3}, answers=True)  # 7.5% > 5%
    profile = _profile(
        tmp_path, target, {"name": "c", "source": "conversations_jsonl", "path": str(path), "regenerate": False}
    )
    with pytest.raises(BadDataError, match="3/40 inputs are bad") as err:
        tokenize_partition(TokenizeSettings.from_profile(profile), "c", ArtifactLayout.from_profile(profile))
    assert "this template cannot render POISON" in str(err.value)
