"""Profiles: every checked-in profile validates; a bad one names the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_dagster.config import CONFIG_DIR, ProfileError, load_profile, load_profile_file


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_checked_in_profile_validates(path: Path) -> None:
    profile = load_profile_file(path)
    assert profile.profile == path.stem


def test_production_profile_matches_the_seed_run() -> None:
    p = load_profile("production")
    assert p.target.kind == "external" and p.target.dtype == "bfloat16"
    assert p.dataset_names[:2] == ["A1_deepswekimi", "A2_kimi_toolcall"]
    assert [n[:2] for n in p.dataset_names[2:]] == [f"B{i}" for i in range(1, 9)]
    assert p.data.drop_datasets == ["A1_deepswekimi"]
    assert p.data.max_seq_len == 8192
    assert p.hidden.aux_layers == [2, 30, 58] and p.hidden.tp_size == 8


def test_unknown_key_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIG_DIR / "micro.yaml").read_text().replace("max_seq_len: 192", "max_seq_length: 192"))
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    assert str(bad) in str(e.value)
    assert "data.max_seq_length" in str(e.value)


def test_bad_value_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIG_DIR / "micro.yaml").read_text().replace("backend: hf", "backend: vllm"))
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    assert "hidden.backend" in str(e.value) and str(bad) in str(e.value)


def test_drop_list_must_name_configured_datasets() -> None:
    with pytest.raises(ProfileError, match="drop_datasets"):
        load_profile("micro", overrides={"data": {"drop_datasets": ["nope"]}})


def test_profile_is_chosen_by_environment_variable(monkeypatch) -> None:
    monkeypatch.setenv("EAGLE3_PROFILE", "micro")
    assert load_profile().profile == "micro"
    monkeypatch.setenv("EAGLE3_PROFILE", "no_such_profile")
    with pytest.raises(ProfileError, match="known profiles"):
        load_profile()
