"""Every profile field is described and every number bounded; a bad value is a ProfileError naming file and field."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from eagle3_dagster.config import CONFIG_DIR, Profile, ProfileError, load_profile, load_profile_file


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        yield f"{prefix}{name}", info
        for arg in [info.annotation, *typing.get_args(info.annotation)]:
            for inner in [arg, *typing.get_args(arg)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    yield from _fields(inner, f"{prefix}{name}.")


def _is_union(annotation) -> bool:
    return isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union


def _number_slots(annotation, constraints=()):
    """(path inside the field, constraints) of each int or float the annotation holds: the field itself (or
    its Optional), or an element of a list, tuple or dict, whose bounds come from its own Annotated[...]."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        yield from _number_slots(base, [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])])
    elif annotation in (int, float):
        yield "", list(constraints)
    elif _is_union(annotation):
        for arg in typing.get_args(annotation):
            yield from _number_slots(arg, constraints)
    else:
        for i, arg in enumerate(a for a in typing.get_args(annotation) if a is not Ellipsis):
            yield from ((f"[{i}]{path}", c) for path, c in _number_slots(arg))


def _bound(constraints, *names) -> bool:
    return any(hasattr(m, a) for m in constraints for a in names)


def test_every_field_has_a_description_and_every_number_bounds_on_both_sides_with_a_reason():
    undescribed = [name for name, info in _fields(Profile) if not info.description]
    unbounded = [
        f"{name}{path}"
        for name, info in _fields(Profile)
        for path, constraints in _number_slots(info.annotation, info.metadata)
        if not (_bound(constraints, "ge", "gt") and _bound(constraints, "le", "lt"))
    ]
    unexplained = [
        name
        for name, info in _fields(Profile)
        if any(True for _ in _number_slots(info.annotation)) and not (info.json_schema_extra or {}).get("bounds")
    ]
    assert undescribed == [] and unbounded == [] and unexplained == []


def _numbers_of(model: type[BaseModel], prefix: tuple = ()):
    """(path, field) of every plain number in nested sections (lists of sections are left to the walk above)."""
    for name, info in model.model_fields.items():
        inner = info.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from _numbers_of(inner, (*prefix, name))
        elif any(path == "" for path, _ in _number_slots(inner)):
            yield (*prefix, name), info


@pytest.mark.parametrize("path", [".".join(p) for p, _ in _numbers_of(Profile)])
def test_every_number_as_large_as_10_to_the_30_is_refused_naming_the_field_and_the_reason(path):
    overrides: dict = {}
    node = overrides
    *sections, name = path.split(".")
    for s in sections:
        node = node.setdefault(s, {})
    node[name] = 10**30
    with pytest.raises(ProfileError) as e:
        load_profile("micro", overrides=overrides)
    info = dict(_numbers_of(Profile))[tuple(path.split("."))]
    assert f"{path}: Input should be less than" in str(e.value)
    assert f"({info.json_schema_extra['bounds']})" in str(e.value)


@pytest.mark.parametrize(
    "path,value",
    [
        ("hidden.aux_layers", [1, 10**30]),
        ("bench.temperatures", [0.0, 1e30]),
        ("bench.spec_configs", [[3, 1, 10**30]]),
        ("train.betas", [0.9, 1e30]),
    ],
)
def test_a_number_in_a_list_as_large_as_10_to_the_30_is_refused_naming_the_field(path, value):
    section, name = path.split(".")
    with pytest.raises(ProfileError) as e:
        load_profile("micro", overrides={section: {name: value}})
    assert f"{path}." in str(e.value) and "Input should be less than" in str(e.value)


def _profile_with(tmp_path: Path, old: str, new: str) -> Path:
    text = (CONFIG_DIR / "micro.yaml").read_text()
    assert old in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(old, new, 1))
    return bad


@pytest.mark.parametrize(
    "old,new,field",
    [
        ("checkpoint_every: 5", "checkpoint_every: 0", "train.checkpoint_every"),
        ("shuffle_seed: 42", "shuffle_seed: -1", "data.shuffle_seed"),
        ("temperature: 0.0", "temperature: 0.0\n  timeout_s: 0", "generation.timeout_s"),
        ("epochs: 2", "epochs: 0", "train.epochs"),
        ("\n  lr: 0.003", "\n  lr: -0.1", "train.lr"),
        ("num_prompts: 4", "num_prompts: 0", "bench.num_prompts"),
        (
            "throughput_tokens_per_s: 5000",
            "throughput_tokens_per_s: 5000\n  backfill_cron: '61 * * * *'",
            "hidden.backfill_cron",
        ),
        (
            "throughput_tokens_per_s: 5000",
            "throughput_tokens_per_s: 5000\n  backfill_cron: 'every ten minutes'",
            "hidden.backfill_cron",
        ),
        ("spec_configs: [[3, 1, 4]]", "spec_configs: [[0, 1, 4]]", "bench.spec_configs"),
    ],
)
def test_a_bad_number_or_cron_is_a_profile_error_naming_file_and_field(tmp_path, old, new, field):
    bad = _profile_with(tmp_path, old, new)
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    assert str(bad) in str(e.value) and field in str(e.value)


def dagster_accepts_cron(cron: str) -> bool:
    """Whether Dagster takes `cron` as a schedule (its public API: a ScheduleDefinition refuses a bad one)."""
    import dagster as dg

    try:
        dg.ScheduleDefinition(name="probe", cron_schedule=cron, job_name="probe")
    except dg.DagsterInvalidDefinitionError:
        return False
    return True


@pytest.mark.parametrize("cron", ["*/10 * * * *", "0 3 * * 1-5", "15,45 */2 1 jan,jul mon", "@daily", "0 0 L * *"])
def test_cron_strings_dagster_accepts_are_accepted(tmp_path, cron):
    bad = _profile_with(
        tmp_path, "throughput_tokens_per_s: 5000", f"throughput_tokens_per_s: 5000\n  backfill_cron: '{cron}'"
    )
    if dagster_accepts_cron(cron):
        assert load_profile_file(bad).hidden.backfill_cron == cron
    else:
        with pytest.raises(ProfileError, match="hidden.backfill_cron"):
            load_profile_file(bad)


def test_a_budget_without_a_price_bound_is_refused_naming_the_field(tmp_path):
    bad = _profile_with(tmp_path, "temperature: 0.0", "temperature: 0.0\n  budget_usd: 10")
    text = bad.read_text().replace("backend: local", "backend: openai\n  base_url: http://x/v1\n  model: m", 1)
    bad.write_text(text)
    with pytest.raises(ProfileError, match="generation.price_usd_per_completion_token"):
        load_profile_file(bad)


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".hidden", "", "with space", "x" * 65, "é"])
def test_a_dataset_name_outside_the_safe_alphabet_is_refused_when_the_profile_loads(tmp_path, name):
    bad = _profile_with(tmp_path, "  - name: sharegpt", f"  - name: {name!r}")
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    assert str(bad) in str(e.value) and "datasets.0.name" in str(e.value) and "not a dataset name" in str(e.value)


def test_two_datasets_whose_names_differ_only_in_case_are_refused_naming_both(tmp_path):
    second = "  - name: ShareGPT\n    source: sharegpt\n"
    bad = _profile_with(tmp_path, "generation:", second + "generation:")
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    assert "datasets[1].name: 'ShareGPT' is already the name of datasets[0] ('sharegpt')" in str(e.value)


def test_a_top_level_key_given_twice_is_refused_naming_the_key_and_the_file(tmp_path):
    bad = _profile_with(tmp_path, "hidden:", "data:\n  max_seq_len: 64\nhidden:")
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    assert str(bad) in str(e.value) and "key 'data' appears twice" in str(e.value)


@pytest.mark.parametrize(
    "section,field,line",
    [  # numbers of a list of sections; the others: above
        ("datasets.0", "max_conversations", "    max_conversations: 64"),
        ("datasets.0", "max_turns", "    max_turns: 1"),
    ],
)
def test_a_dataset_number_as_large_as_10_to_the_30_is_refused_naming_the_field(tmp_path, section, field, line):
    indent = line[: len(line) - len(line.lstrip())]
    new = f"{line}\n{indent}{field}: {10**30}" if not line.strip().startswith(field) else f"{indent}{field}: {10**30}"
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIG_DIR / "micro.yaml").read_text().replace(line, new, 1))
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    assert f"{section}.{field}" in str(e.value) and "less than or equal" in str(e.value)
    assert str(bad) in str(e.value) and "a larger number is a typo" in str(e.value)  # the file, the reason
