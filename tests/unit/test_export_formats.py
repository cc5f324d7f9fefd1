"""Exports read back the way SpecForge and speculators read them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from eagle3_dagster.hidden.export_formats import (
    export_specforge,
    export_speculators,
    load_final_norm_weight,
    pre_norm_equivalent,
    specforge_path,
)
from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.shards import ShardFormat, ShardWriter

H = 8
EPS = 1e-6


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The target's final norm, as speculators' verifier_norm applies it."""
    x32 = x.float()
    return (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS))).to(x.dtype)


@pytest.fixture()
def version(tmp_path):
    g = torch.Generator().manual_seed(0)
    norm_w = torch.rand(H, generator=g) + 0.5
    fmt = ShardFormat(hidden_size=H, dtype="float32", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    lengths = {"ds/0": 3, "ds/1": 6, "ds/2": 2}
    version_dir = tmp_path / "hs-000000000000"
    with ShardWriter(version_dir, "shard-00000", fmt, list(lengths), list(lengths.values())) as w:
        for sid, n in lengths.items():
            residual = torch.randn(n, H, generator=g) * 3.0
            w.write_sample(
                sid,
                input_ids=torch.randint(0, 50, (n,), generator=g),
                loss_mask=torch.randint(0, 2, (n,), generator=g),
                aux_hidden=torch.randn(n, 3 * H, generator=g),
                last_hidden=_rms_norm(residual, norm_w),
            )
    return version_dir, norm_w


def test_specforge_export_has_its_keys_shapes_and_file_layout(version, tmp_path):
    version_dir, _ = version
    out = tmp_path / "specforge"
    assert export_specforge(version_dir, out, group_size=2) == 3
    assert specforge_path(out, 2, 2) == out / "rows_2-4" / "data_2.ckpt"
    ds = HiddenStatesDataset(version_dir)
    for i in range(3):
        d = torch.load(specforge_path(out, i, 2), weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        n = ds.lengths()[i]
        assert d["input_ids"].dtype == torch.int64 and d["loss_mask"].dtype == torch.int64
        assert d["hidden_state"].shape == (1, n, H) and d["aux_hidden_state"].shape == (1, n, 3 * H)
        # SpecForge expects post-norm, as stored, in the bfloat16 its TargetHead and draft compute in
        assert d["hidden_state"].dtype == d["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(d["hidden_state"][0], ds[i]["last_hidden"].to(torch.bfloat16))
        assert torch.equal(d["aux_hidden_state"][0], ds[i]["aux_hidden"].to(torch.bfloat16))
        assert torch.equal(d["loss_mask"], ds[i]["loss_mask"])


def test_speculators_export_reconstructs_teacher_and_features(version, tmp_path):
    from datasets import load_from_disk

    version_dir, norm_w = version
    out = tmp_path / "speculators"
    assert export_speculators(version_dir, out, final_norm_weight=norm_w) == 3
    ds = HiddenStatesDataset(version_dir)
    arrow = load_from_disk(str(out))
    assert arrow.column_names == ["input_ids", "loss_mask", "seq_len"]
    for i in range(3):
        row = arrow[i]
        hs = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert set(hs) == {"token_ids", "hidden_states"}
        # what speculators' ArrowDataset does with the files
        assert torch.equal(hs["token_ids"], row["input_ids"]) and int(row["seq_len"]) == ds.lengths()[i]
        assert torch.equal(row["loss_mask"], ds[i]["loss_mask"])
        assert hs["hidden_states"].shape == (ds.lengths()[i], 4, H)
        assert torch.equal(hs["hidden_states"][:, :-1].flatten(1), ds[i]["aux_hidden"])
        teacher = _rms_norm(hs["hidden_states"][:, -1], norm_w)  # speculators: lm_head(verifier_norm(last))
        torch.testing.assert_close(teacher, ds[i]["last_hidden"], atol=1e-5, rtol=1e-5)


def test_pre_norm_equivalent_refuses_a_zero_norm_weight():
    with pytest.raises(ValueError, match="zeros at \\[1\\]"):
        pre_norm_equivalent(torch.ones(2, 3), torch.tensor([1.0, 0.0, 2.0]))


def test_speculators_export_checks_the_norm_weight_matches_the_shards(version, tmp_path):
    version_dir, _ = version
    with pytest.raises(ValueError, match="hidden 8"):
        export_speculators(version_dir, tmp_path / "o", final_norm_weight=torch.ones(4))


def test_final_norm_weight_is_read_from_the_target_checkpoint(micro_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(micro_target), dtype=torch.float32)
    assert torch.equal(load_final_norm_weight(micro_target), model.model.norm.weight.detach())


@pytest.fixture()
def float32_target(tmp_path):
    """A float32 target as the tiny build writes it: config.json and one model.safetensors, no index."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    d = tmp_path / "target"
    LlamaConfig(
        hidden_size=H,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=50,
    ).save_pretrained(str(d))
    g = torch.Generator().manual_seed(3)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(50, H, generator=g),
            "lm_head.weight": torch.randn(50, H, generator=g),
        },
        str(d / "model.safetensors"),
    )
    return d


def test_specforge_releases_own_reader_target_head_and_draft_take_our_float32_export(
    version, tmp_path, float32_target, monkeypatch
):
    """SpecForge 0.2.0 from PyPI: its offline reader, EAGLE-3 normaliser, TargetHead and draft fc on our files."""
    from tests.specforge_release import release_dir

    from eagle3_dagster.hidden.export_formats import specforge_target_dir
    from eagle3_dagster.target import target_identity

    monkeypatch.syspath_prepend(str(release_dir()))
    from transformers import LlamaConfig

    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    version_dir, _ = version
    ds = HiddenStatesDataset(version_dir)
    assert ds[0]["last_hidden"].dtype == torch.float32  # what a float32 target's extraction stores

    with pytest.raises(FileNotFoundError, match="No index.json file found"):  # what SpecForge says of the target
        TargetHead.from_pretrained(str(float32_target))
    identity = target_identity(float32_target)
    target = specforge_target_dir(float32_target, tmp_path / "specforge")
    assert target == tmp_path / "specforge" / "target_model" and target_identity(float32_target) == identity
    head = TargetHead.from_pretrained(str(target))  # bfloat16, always
    draft = LlamaForCausalLMEagle3(
        LlamaConfig(
            hidden_size=H,
            intermediate_size=16,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_hidden_layers=1,
            vocab_size=50,
            draft_vocab_size=20,
        )
    ).to(torch.bfloat16)

    old = tmp_path / "float32_features"
    export_specforge(version_dir, old, dtype=torch.float32)  # what the export wrote before it was bfloat16
    raw = load_feature_file(str(specforge_path(old, 0)))
    with pytest.raises(RuntimeError, match="same dtype"):
        head(normalize_offline_sample(raw, 2048)["target"])

    out = tmp_path / "specforge"
    export_specforge(version_dir, out)
    refs = OfflineManifestReader(str(out), validate_files=True).read()  # the eager pass checks keys and tensors
    assert len(refs) == 3
    for i, ref in enumerate(refs):
        sample = normalize_offline_sample(load_feature_file(ref.feature_store_uri.removeprefix("file://")), 2048)
        n = ds.lengths()[i]
        logits = head(sample["target"])  # the teacher
        assert logits.shape == (1, n, 50) and logits.dtype == torch.bfloat16
        want = ds[i]["last_hidden"].to(torch.bfloat16) @ head.fc.weight.T
        assert torch.equal(logits[0], want)
        assert draft.project_hidden_states(sample["hidden_state"]).shape == (1, n, H)  # the draft's fc
        assert torch.equal(sample["input_ids"][0], ds[i]["input_ids"])
