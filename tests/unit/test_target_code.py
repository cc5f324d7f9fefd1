"""The Python a target folder carries (what `--trust-remote-code` runs) is part of the target's identity, is
listed with its sha256 where the target is materialized or observed (`code_files`), and, with
`target.reviewed_code` set, anything but the reviewed code is refused before any of it runs: in the tokenizer
loader and at the SGLang launch on the host. Before, an edited or added file ran, marked nothing stale, and
nothing compared it with what was reviewed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_dagster import target_code
from eagle3_dagster.gpu_host import GpuHost, program_argv
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.target import load_tokenizer, target_identity
from eagle3_dagster.target_code import UnreviewedCodeError, code_files

# The tokenizer's own code: it records that it ran (RAN names a file beside the folder), then loads tokenizer.json.
TOKENIZER_CODE = """
from transformers import PreTrainedTokenizerFast

open({ran!r}, "a").write("ran\\n")


class ProbeTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A small model folder whose tokenizer is remote code (tokenizer_config.json auto_map), as Kimi-K2.5's is."""
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "vocab_size": 3,
                "auto_map": {"AutoModelForCausalLM": "modeling_probe.ProbeForCausalLM"},
            }
        )
    )
    save_file({"lm_head.weight": torch.zeros(3, 8)}, str(folder / "model.safetensors"))
    _tokenizer_json(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "ProbeTokenizer",
                "unk_token": "[UNK]",
                "auto_map": {"AutoTokenizer": [None, "tokenization_probe.ProbeTokenizer"]},
            }
        )
    )
    (folder / "tokenization_probe.py").write_text(TOKENIZER_CODE.format(ran=str(tmp_path / "ran")))
    (folder / "modeling_probe.py").write_text("# the model class a real checkpoint ships\n")
    return folder


def _ran(target: Path) -> bool:
    return (target.parent / "ran").exists()


def test_code_files_are_every_python_file_at_any_depth_with_its_sha256(target):
    (target / "sub").mkdir()
    (target / "sub" / "helper.py").write_text("X = 1\n")
    (target / "notes.txt").write_text("not code")
    assert code_files(target) == {
        name: _sha(target / name) for name in ["modeling_probe.py", "sub/helper.py", "tokenization_probe.py"]
    }


@pytest.mark.parametrize(
    "attack",
    [
        "edit the tokenizer's code",
        "add a module beside it",
        "add one in a folder",
        "edit the model code auto_map names",
        "edit code a link points at, outside",
        "edit code in a linked folder, outside",
    ],
)
def test_an_edited_or_added_code_file_changes_the_target_identity(target, attack, tmp_path):
    outside = tmp_path / "elsewhere.py"
    if attack == "edit code a link points at, outside":
        outside.write_text("X = 1\n")
        (target / "linked.py").symlink_to(outside)
    elif attack == "edit code in a linked folder, outside":
        (tmp_path / "pkg").mkdir()
        outside = tmp_path / "pkg" / "impl.py"
        outside.write_text("X = 1\n")
        (target / "pkg").symlink_to(tmp_path / "pkg")
        (tmp_path / "pkg" / "loop").symlink_to(tmp_path / "pkg")  # a cycle is walked once
    before = target_identity(target)
    if attack == "edit the tokenizer's code":
        (target / "tokenization_probe.py").write_text((target / "tokenization_probe.py").read_text() + "\nX = 1\n")
    elif attack == "add a module beside it":
        (target / "kimi_k25_processor.py").write_text("import os\n")
    elif attack == "add one in a folder":
        (target / "vendor").mkdir()
        (target / "vendor" / "tiktoken_ext.py").write_text("import os\n")
    elif attack == "edit the model code auto_map names":
        (target / "modeling_probe.py").write_text("import os  # runs with AutoModelForCausalLM\n")
    else:
        outside.write_text("import os\n")
    assert target_identity(target) != before


def test_copying_the_folder_keeps_the_identity_and_a_folder_without_code_ignores_non_code_files(target, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(target, copy)
    assert target_identity(copy) == target_identity(target)
    for name in ("tokenization_probe.py", "modeling_probe.py"):
        (copy / name).unlink()
    plain = target_identity(copy)
    (copy / "README.md").write_text("a model card")
    assert target_identity(copy) == plain


def test_target_info_lists_the_code_files_with_their_sha256(target, capsys):
    from eagle3_dagster.cli import main

    assert main(["target-info", str(target)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["code_files"] == {
        "modeling_probe.py": _sha(target / "modeling_probe.py"),
        "tokenization_probe.py": _sha(target / "tokenization_probe.py"),
    }
    assert info["identity"] == target_identity(target)


def test_the_observed_target_lists_its_code_files_and_an_edit_gives_a_new_data_version(target, tmp_path):
    import dagster as dg

    from assets import target_model
    from eagle3_dagster.config import load_profile
    from resources.gpu_host import GpuHostResource, HostEntry
    from resources.profile import ProfileResource

    profile = load_profile("micro", overrides={"target": {"kind": "external", "path": str(target)}})
    asset = target_model.for_profile(profile)
    host = GpuHostResource(hosts=[HostEntry(python=sys.executable, workdir=str(tmp_path / "host"))])

    defs = dg.Definitions(
        assets=[asset],
        resources={"gpu_host": host, "profile": ProfileResource.of(profile)},
        jobs=[dg.define_asset_job("observe_target", selection=[asset.key])],
    )

    def observed(instance):  # a job selecting the observable target observes it (Dagster's public API)
        result = defs.resolve_job_def("observe_target").execute_in_process(instance=instance)
        (event,) = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
        return event.event_specific_data.asset_observation

    with dg.instance_for_test() as instance:
        first = observed(instance)
        assert first.metadata["code_files"].value == code_files(target)
        (target / "tokenization_probe.py").write_text("import os\n")
        second = observed(instance)
        assert second.tags["dagster/data_version"] != first.tags["dagster/data_version"]
        assert second.metadata["code_files"].value["tokenization_probe.py"] == _sha(target / "tokenization_probe.py")


def test_the_reviewed_code_loads_and_runs(target):
    reviewed = code_files(target)
    tok = load_tokenizer(target, trust_remote_code=True, reviewed_code=reviewed)
    assert type(tok).__name__ == "ProbeTokenizer" and _ran(target)


@pytest.mark.parametrize("attack", ["edited", "added", "added in a folder", "unlisted"])
def test_code_that_is_not_the_reviewed_code_is_refused_before_it_runs_naming_the_file_and_both_hashes(target, attack):
    reviewed = code_files(target)
    name = {
        "edited": "tokenization_probe.py",
        "added": "extra.py",
        "added in a folder": "pkg/extra.py",
        "unlisted": "modeling_probe.py",
    }[attack]
    path = target / name
    path.parent.mkdir(exist_ok=True)
    if attack == "unlisted":
        del reviewed[name]
    else:
        path.write_text((path.read_text() if path.exists() else "") + "\nopen('/tmp/x', 'w')\n")
    with pytest.raises(UnreviewedCodeError) as refused:
        load_tokenizer(target, trust_remote_code=True, reviewed_code=reviewed)
    said = str(refused.value)
    assert name in said and _sha(path) in said and "target.reviewed_code" in said
    if attack == "edited":
        assert reviewed[name] in said  # both hashes
    assert not _ran(target)


def test_a_code_file_that_is_not_a_regular_file_is_refused(target):
    os.mkfifo(target / "fifo.py")  # reading it would block forever; its bytes cannot be pinned
    with pytest.raises(UnreviewedCodeError, match="fifo.py.*not a regular file"):
        code_files(target)


def test_without_trust_remote_code_nothing_is_checked_and_nothing_runs(target):
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_tokenizer(target, trust_remote_code=False, reviewed_code={})
    assert not _ran(target)


def test_the_profile_takes_reviewed_code_as_sha256_values_only(target):
    from eagle3_dagster.config import ProfileError, load_profile

    good = {
        "target": {
            "kind": "external",
            "path": str(target),
            "trust_remote_code": True,
            "reviewed_code": code_files(target),
        }
    }
    assert load_profile("micro", overrides=good).target.reviewed_code == code_files(target)
    with pytest.raises((ProfileError, ValueError), match="reviewed_code"):
        load_profile("micro", overrides={"target": {**good["target"], "reviewed_code": {"x.py": "not-a-hash"}}})


def test_the_check_runs_on_a_bare_interpreter_as_the_host_runs_it(target, tmp_path):
    reviewed = code_files(target)
    python, *rest = program_argv(sys.executable, target_code, "check", target, json.dumps(reviewed))
    env = {**os.environ, "PYTHONPATH": ""}
    ok = subprocess.run([python, "-S", *rest], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stderr
    (target / "tokenization_probe.py").write_text("import os\n")
    refused = subprocess.run([python, "-S", *rest], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert refused.returncode == target_code.EXIT_UNREVIEWED
    assert (
        _sha(target / "tokenization_probe.py") in refused.stderr and reviewed["tokenization_probe.py"] in refused.stderr
    )


def test_the_sglang_launch_refuses_unreviewed_code_on_the_host_before_starting_anything(target, tmp_path):
    from eagle3_dagster.sglang.server import ServerSpec, sglang_server

    reviewed = code_files(target)
    (target / "tokenization_probe.py").write_text("import os\n")
    started = tmp_path / "launched"
    launcher = (sys.executable, "-c", f"open({str(started)!r}, 'w').close()")
    host = GpuHost(HostConfig(workdir=str(tmp_path / "work")))
    spec = ServerSpec(
        model_path=str(target),
        port=1,
        launcher=launcher,
        trust_remote_code=True,
        reviewed_code=reviewed,
        health_timeout_s=5,
    )
    with pytest.raises(UnreviewedCodeError) as refused:
        with sglang_server(host, spec, on_log=lambda _line: None):
            pass
    said = str(refused.value)
    assert "tokenization_probe.py" in said and reviewed["tokenization_probe.py"] in said
    assert _sha(target / "tokenization_probe.py") in said
    assert not started.exists()
