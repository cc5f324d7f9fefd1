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
from eagle3_dagster.hidden.shards import HiddenStatesDataset, ShardFormat, ShardWriter

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
            w.write_sample(sid, input_ids=torch.randint(0, 50, (n,), generator=g), loss_mask=torch.randint(0, 2, (n,), generator=g),
                           aux_hidden=torch.randn(n, 3 * H, generator=g), last_hidden=_rms_norm(residual, norm_w))
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
        assert torch.equal(d["hidden_state"][0], ds[i]["last_hidden"])  # SpecForge expects post-norm, as stored
        assert torch.equal(d["aux_hidden_state"][0], ds[i]["aux_hidden"])
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
