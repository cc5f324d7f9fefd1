"""A drafter folder from elsewhere is foreign input: every value and file is checked where it is read.

The folders are SpecForge's `export --to sglang` layout (tests/specforge_format.py) with one thing changed,
as a hand-edited or hostile config.json, a sharded index, or a link would change it. Each is refused with a
`ForeignInputError` whose one-line message names the file and the field; `eagle3 bench --drafter` prints it
as one line and exits 2 (before: NaN RoPE bases and aux layer 0 benchmarked with rc 0, other folders gave
30-40-line tracebacks naming no file, and an index pointing outside measured another folder's weights).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from eagle3_dagster.drafter.imported import load_any_drafter
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from tests.specforge_format import draft_config, small_drafter, write_specforge_export, write_target_head

V, H, DV, L = 48, 16, 12, 8
WEIGHTS = "model.safetensors"


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    """An 8-layer DeepSeek-V3 target's config and embedding (all the loader reads of a target)."""
    return write_target_head(tmp_path / "target", vocab=V, hidden=H, layers=L)


def _drafter(embed: torch.Tensor, aux_layers=(2, 4, 5)) -> Eagle3Drafter:
    return small_drafter(embed, draft_vocab=DV, aux_layers=aux_layers)


@pytest.fixture
def good(tmp_path: Path, target_dir: Path) -> Path:
    """SpecForge's `export --to sglang` of a drafter for the target, with SGLang ids for [2, 4, 5]."""
    from eagle3_dagster.drafter.target_head import load_target_tensors

    drafter = _drafter(load_target_tensors(target_dir, ("embed",)).embed)
    return write_specforge_export(drafter, tmp_path / "good", draft_config(drafter, eagle_aux_ids=[1, 3, 4]))


def refused(call, *fragments: str) -> str:
    """`call()` raises a ForeignInputError (by name, so that this runs on code without it too) whose message is
    one line holding every fragment; the message."""
    with pytest.raises(Exception) as e:
        call()
    assert type(e.value).__name__ == "ForeignInputError", f"{type(e.value).__name__}: {e.value}"
    message = str(e.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _edited(good: Path, where: Path, edit) -> Path:
    shutil.copytree(good, where)
    cfg = json.loads((where / "config.json").read_text())
    edit(cfg)
    (where / "config.json").write_text(json.dumps(cfg))  # Python's json writes NaN and Infinity, as HF's does
    return where


NAN, INF = float("nan"), float("inf")
CONFIG_ATTACKS = {
    # field → value: a number out of range, or of the wrong type (a bool is an int to Python: True == 1)
    "rope_theta_nan": ("rope_theta", NAN),
    "rope_theta_inf": ("rope_theta", INF),
    "rope_theta_zero": ("rope_theta", 0),
    "rope_theta_negative": ("rope_theta", -10000.0),
    "rope_theta_string": ("rope_theta", "10000"),
    "rms_norm_eps_negative": ("rms_norm_eps", -1),
    "rms_norm_eps_negative_float": ("rms_norm_eps", -1.0),
    "rms_norm_eps_nan": ("rms_norm_eps", NAN),
    "rms_norm_eps_zero": ("rms_norm_eps", 0.0),
    "heads_zero": ("num_attention_heads", 0),
    "heads_bool": ("num_attention_heads", True),
    "heads_float": ("num_attention_heads", 4.0),
    "heads_huge": ("num_attention_heads", 10**30),
    "heads_string": ("num_attention_heads", "4"),
    "kv_heads_negative": ("num_key_value_heads", -2),
    "intermediate_huge": ("intermediate_size", 2**63),
    "max_positions_zero": ("max_position_embeddings", 0),
    "layers_bool": ("num_hidden_layers", True),
    "tie_int": ("tie_word_embeddings", 0),
    "fc_norm_string": ("fc_norm", "false"),
    "rope_parameters_list": ("rope_parameters", [10000.0]),
    "eagle_config_list": ("eagle_config", [1, 3, 4]),
}


@pytest.mark.parametrize("attack", sorted(CONFIG_ATTACKS))
def test_a_config_value_out_of_range_or_of_the_wrong_type_is_refused_naming_the_file_and_field(
    attack, tmp_path, good, target_dir
):
    key, value = CONFIG_ATTACKS[attack]
    folder = _edited(good, tmp_path / attack, lambda c: c.__setitem__(key, value))
    refused(lambda: load_any_drafter(folder, target_dir), str(folder / "config.json"), f"{key}=")


@pytest.mark.parametrize(
    "attack, edit, field",
    [
        (
            "nested_rope_nan",
            lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": NAN}),
            "rope_parameters.rope_theta=nan",
        ),
        (
            "heads_not_dividing_hidden",
            lambda c: c.update(num_attention_heads=3, num_key_value_heads=1, head_dim=None),
            "num_attention_heads=3 does not divide hidden_size=16",
        ),
        (
            "heads_not_dividing_hidden_with_head_dim",
            lambda c: c.update(num_attention_heads=3, num_key_value_heads=1),
            "LlamaConfig refuses it",
        ),
        ("kv_not_dividing_heads", lambda c: c.update(num_key_value_heads=3), "num_key_value_heads=3 does not divide"),
        ("odd_head_dim", lambda c: c.update(head_dim=5), "head_dim=5"),
        ("draft_vocab_over_vocab", lambda c: c.update(draft_vocab_size=V + 1), f"draft_vocab_size={V + 1}"),
        (
            "aux_ids_strings",
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=["1", "3", "x"]),
            "eagle_config.eagle_aux_hidden_state_layer_ids=",
        ),
        (
            "aux_ids_floats",
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1.5, 3, 4]),
            "eagle_config.eagle_aux_hidden_state_layer_ids=",
        ),
        (
            "aux_ids_bools",
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[True, 3, 4]),
            "eagle_config.eagle_aux_hidden_state_layer_ids=",
        ),
    ],
)
def test_sizes_that_must_divide_and_layer_ids_that_must_be_integers_are_refused(
    attack, edit, field, tmp_path, good, target_dir
):
    folder = _edited(good, tmp_path / attack, edit)
    refused(lambda: load_any_drafter(folder, target_dir), str(folder / "config.json"), field)


@pytest.mark.parametrize(
    "text, says",
    [
        ("[1, 2, 3]", "a JSON list"),
        ('"LlamaForCausalLMEagle3"', "a JSON str"),
        ('{"hidden_size": 16,', "not valid JSON"),
        ("\xff\xfe", "not valid JSON"),
    ],
)
def test_a_config_json_that_is_not_an_object_is_refused_naming_it(text, says, tmp_path, good, target_dir):
    folder = tmp_path / "bad"
    shutil.copytree(good, folder)
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    refused(lambda: load_any_drafter(folder, target_dir), str(folder / "config.json"), says)


def test_aux_layer_0_is_refused_as_the_profile_refuses_it_for_the_same_target(tmp_path, good, target_dir):
    """SGLang 0.5.23 reads ids not starting at 1 as canonical: [0, 4, 5] captures the embeddings. The profile's
    hidden.aux_layers must lie in [1, L-1] (layers.validate_aux_layers, target.target_facts)."""
    folder = _edited(
        good, tmp_path / "aux0", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 4, 5])
    )
    refused(
        lambda: load_any_drafter(folder, target_dir),
        str(folder / "config.json"),
        "aux layers [0, 4, 5]",
        "must lie in [1, 7]",
    )
    # 0.5.12 adds one to every id: [-1, 3, 4] is canonical [0, 4, 5] there
    old_release = _edited(
        good, tmp_path / "aux0_0512", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[-1, 3, 4])
    )
    refused(lambda: load_any_drafter(old_release, target_dir, sglang_version="0.5.12"), "aux layers [0, 4, 5]")
    beyond = _edited(
        good, tmp_path / "aux8", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 7])
    )  # canonical [2, 4, 8]: 8 is the post-norm output
    refused(lambda: load_any_drafter(beyond, target_dir), "aux layers [2, 4, 8]")


def test_a_config_carrying_this_projects_field_is_checked_as_foreign_too(tmp_path, target_dir):
    """`eagle3_dagster_aux_layers_canonical` routes a folder to the strict reader of this project's exports; a
    folder from elsewhere can carry it, so its aux layers meet the profile's rule for the target as well."""
    from eagle3_dagster.drafter.export import export_drafter
    from eagle3_dagster.drafter.target_head import load_target_tensors

    embed = load_target_tensors(target_dir, ("embed",)).embed
    export = export_drafter(
        _drafter(embed, aux_layers=(0, 4, 5)), tmp_path / "own0", serving_context=512, sglang_versions=["0.5.23"]
    )
    refused(
        lambda: load_any_drafter(export, target_dir),
        str(export / "config.json"),
        "aux layers [0, 4, 5]",
        "eagle3_dagster_aux_layers_canonical",
    )
    text = _edited(export, tmp_path / "own_strings", lambda c: c.update(eagle3_dagster_aux_layers_canonical="2,4,5"))
    refused(lambda: load_any_drafter(text, target_dir), "eagle3_dagster_aux_layers_canonical='2,4,5'")


def _indexed(good: Path, where: Path, file_name: str) -> Path:
    """`good` as a sharded save writes it: weights renamed, an index naming `file_name` for every tensor."""
    from safetensors import safe_open

    shutil.copytree(good, where)
    (where / WEIGHTS).rename(where / "model-00001-of-00001.safetensors")
    with safe_open(str(where / "model-00001-of-00001.safetensors"), "pt") as h:
        names = list(h.keys())
    (where / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": {n: file_name for n in names}})
    )
    return where


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, good, target_dir):
    """Before, each of these loaded and benchmarked the other folder's weights under this folder's name."""
    other = tmp_path / "other"
    shutil.copytree(good, other)
    assert load_any_drafter(_indexed(good, tmp_path / "inside", "model-00001-of-00001.safetensors"), target_dir)
    for name, file_name in (
        ("absolute", str(other / WEIGHTS)),
        ("dotdot", "../other/model.safetensors"),
        ("dotdot_in_the_middle", "sub/../../other/model.safetensors"),
        ("dotdot_staying_inside", "sub/../model-00001-of-00001.safetensors"),
    ):
        folder = _indexed(good, tmp_path / name, file_name)
        (folder / "sub").mkdir()
        refused(
            lambda: load_any_drafter(folder, target_dir),
            str(folder / "model.safetensors.index.json"),
            "weight_map[",
            repr(file_name),
        )
    linked = _indexed(good, tmp_path / "linked_folder", "sub/model.safetensors")
    (linked / "sub").symlink_to(other)  # a relative name whose folder is a link out
    refused(lambda: load_any_drafter(linked, target_dir), "weight_map[", f"to {other / WEIGHTS}")
    for name, weight_map in (("not_a_name", 5), ("empty", {})):
        folder = _indexed(good, tmp_path / name, "x")
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: weight_map for k in index["weight_map"]} if weight_map == 5 else weight_map
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        refused(lambda: load_any_drafter(folder, target_dir), str(folder / "model.safetensors.index.json"))


def test_a_target_index_naming_a_file_outside_its_folder_is_refused(tmp_path, target_dir):
    """The target folder is foreign too (a hub checkpoint): before, the embedding and LM head were read from
    wherever its index pointed (drafter.target_head kept an index reader of its own, without the check)."""
    from eagle3_dagster.drafter.target_head import load_target_tensors

    other = tmp_path / "other"
    shutil.copytree(target_dir, other)
    sharded = _indexed(target_dir, tmp_path / "sharded", "model-00001-of-00001.safetensors")
    assert load_target_tensors(sharded, ("embed",)).embed is not None  # an index inside the folder: read
    for name, file_name in (("absolute", str(other / WEIGHTS)), ("dotdot", "../other/model.safetensors")):
        folder = _indexed(target_dir, tmp_path / name, file_name)
        index = str(folder / "model.safetensors.index.json")
        refused(lambda: load_target_tensors(folder, ("embed",)), index, "weight_map[", repr(file_name))
    # a hub cache snapshot: its files are links to ../../blobs/, which a target may be (a drafter folder may not)
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sharded.iterdir():
        shutil.copy(f, blobs / f"sha-{f.name}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"sha-{f.name}")
    assert torch.equal(load_target_tensors(snapshot, ("embed",)).embed, load_target_tensors(sharded, ("embed",)).embed)
    (snapshot / "model-00001-of-00001.safetensors").unlink()
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("/dev/urandom")  # a link must reach a regular file
    refused(lambda: load_target_tensors(snapshot, ("embed",)), "/dev/urandom")


@pytest.mark.timeout(60)  # before: a FIFO blocked safetensors forever
def test_weights_that_are_a_link_out_of_the_folder_a_device_or_a_fifo_are_refused(tmp_path, good, target_dir):
    other = tmp_path / "other"
    shutil.copytree(good, other)
    cases = {
        "urandom": lambda w: w.symlink_to("/dev/urandom"),
        "other_folder": lambda w: w.symlink_to(other / WEIGHTS),
        "fifo": lambda w: os.mkfifo(w),
    }
    for name, make in cases.items():
        folder = tmp_path / name
        shutil.copytree(good, folder)
        (folder / WEIGHTS).unlink()
        make(folder / WEIGHTS)
        refused(lambda: load_any_drafter(folder, target_dir), str(folder / WEIGHTS))
    via_linked_folder = tmp_path / "via_linked_folder"
    shutil.copytree(good, via_linked_folder)
    (via_linked_folder / WEIGHTS).unlink()
    (via_linked_folder / "w").symlink_to(other)
    (via_linked_folder / WEIGHTS).symlink_to(via_linked_folder / "w" / WEIGHTS)
    refused(lambda: load_any_drafter(via_linked_folder, target_dir), f"to {other / WEIGHTS}")
    linked_config = tmp_path / "linked_config"  # another folder's config.json, measured under this name
    shutil.copytree(good, linked_config)
    (linked_config / "config.json").unlink()
    (linked_config / "config.json").symlink_to(other / "config.json")
    refused(lambda: load_any_drafter(linked_config, target_dir), str(linked_config / "config.json"), "symlink")
    garbage = tmp_path / "garbage"
    shutil.copytree(good, garbage)
    (garbage / WEIGHTS).write_bytes(os.urandom(4096))
    refused(lambda: load_any_drafter(garbage, target_dir), str(garbage / WEIGHTS), "not a readable safetensors")
    inside = tmp_path / "link_inside"  # a link that stays in the folder is fine
    shutil.copytree(good, inside)
    (inside / WEIGHTS).rename(inside / "weights.bin.safetensors")
    (inside / WEIGHTS).symlink_to("weights.bin.safetensors")
    assert load_any_drafter(inside, target_dir).source == "external"


@pytest.fixture
def micro_folders(tmp_path: Path, micro_target: Path) -> tuple[Path, dict[str, Path]]:
    """A profile on the micro target (4 layers, SGLang 0.5.12) and a SpecForge export for it, plus attacks."""
    import yaml

    from eagle3_dagster.drafter.target_head import load_target_tensors

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "micro.yaml").read_text())
    raw.update(run_root=str(tmp_path / "run"), gpu_host={"sglang_version": "0.5.12"})
    raw["hidden"]["root"] = str(tmp_path / "hs")
    raw["target"] = {**raw["target"], "kind": "external", "path": str(micro_target)}
    raw["bench"] = {**raw["bench"], "spec_configs": [[2, 1, 3]], "num_prompts": 2, "max_new_tokens": 8}
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(raw))
    target = load_target_tensors(micro_target, ("embed",))
    a = target.arch
    cfg = DrafterConfig.for_target(
        target_hidden_size=a.hidden_size,
        target_intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        draft_vocab_size=64,
        aux_layers=(1, 2, 3),
        num_attention_heads=2,
        rope_theta=a.rope_theta,
        max_position_embeddings=512,
    )
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 128, 2)] = True
    drafter = Eagle3Drafter(cfg, target.embed.float(), torch.arange(0, 128, 2) - torch.arange(64), t2d)
    good = write_specforge_export(drafter, tmp_path / "good", draft_config(drafter, eagle_aux_ids=[0, 1, 2]))
    folders = {
        "rope_theta_nan": _edited(good, tmp_path / "nan", lambda c: c.update(rope_theta=NAN)),
        "rms_norm_eps_negative": _edited(good, tmp_path / "eps", lambda c: c.update(rms_norm_eps=-1.0)),
        "heads_zero": _edited(good, tmp_path / "heads", lambda c: c.update(num_attention_heads=0)),
        "config_list": _edited(good, tmp_path / "list", lambda c: None),
        "urandom": tmp_path / "urandom",
        "index_dotdot": _indexed(good, tmp_path / "dotdot", "../good/model.safetensors"),
        "aux_layer_0": _edited(
            good, tmp_path / "aux0", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[-1, 0, 1])
        ),
    }
    (folders["config_list"] / "config.json").write_text("[1, 2, 3]")
    shutil.copytree(good, folders["urandom"])
    (folders["urandom"] / WEIGHTS).unlink()
    (folders["urandom"] / WEIGHTS).symlink_to("/dev/urandom")
    return profile, folders


EXPECTED_LINE = {
    "rope_theta_nan": ("config.json", "rope_theta=nan"),
    "rms_norm_eps_negative": ("config.json", "rms_norm_eps=-1.0"),
    "heads_zero": ("config.json", "num_attention_heads=0"),
    "config_list": ("config.json", "a JSON list"),
    "urandom": ("model.safetensors", "/dev/urandom"),
    "index_dotdot": ("model.safetensors.index.json", "'../good/model.safetensors'"),
    "aux_layer_0": ("config.json", "aux layers [0, 1, 2]"),
}


def test_eagle3_bench_prints_one_line_naming_the_file_and_field_and_exits_2(micro_folders, capsys):
    """Before: rope_theta NaN and aux layer 0 benchmarked with rc 0 (acceptance 1.000), the others raised
    ZeroDivisionError / TypeError / OSError tracebacks, and the index measured ../good's weights."""
    from eagle3_dagster.cli import main

    profile, folders = micro_folders
    for attack, folder in folders.items():
        rc = main(["--profile", str(profile), "bench", "--drafter", str(folder), "--out", str(folder) + "-out"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        file_name, field = EXPECTED_LINE[attack]
        assert rc == 2, (attack, err)
        assert err.startswith("eagle3 bench: ") and str(folder / file_name) in err and field in err, (attack, err)
        assert not (Path(str(folder) + "-out") / "report.md").exists()
