"""What training reads and hands on is checked: shards against their manifest, every step's loss and gradient,
every exported weight; the benchmark reads only an export a successful materialization names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_dagster.drafter.export import check_export, export_drafter
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_dagster.hidden.shards import ShardCorruptError, shard_path
from eagle3_dagster.train.checkpoint import Checkpointer
from eagle3_dagster.train.schedule import BucketedSampler
from eagle3_dagster.train.loop import LoopConfig, NonFiniteTrainingError, Trainer, TTTObjective
from test_export import _drafter, target_dir  # noqa: F401  (fixture)
from test_shards import SAMPLES, _write
from eagle3_dagster.stages.train import TrainSettings


def test_an_export_with_a_non_finite_weight_is_refused(tmp_path, target_dir):
    out = export_drafter(_drafter(target_dir), tmp_path / "export", serving_context=4096, dtype=torch.float32)
    assert check_export(out).ok
    weights = load_file(str(out / "model.safetensors"))
    weights["midlayer.mlp.down_proj.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    check = check_export(out)
    assert not check.ok and check.non_finite == {"midlayer.mlp.down_proj.weight": 2}
    with pytest.raises(ValueError, match="down_proj"):
        check.raise_for_errors()


def test_training_refuses_to_start_when_a_shard_does_not_match_its_manifest(tmp_path, monkeypatch):
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.stages import train as train_stage

    version_dir = tmp_path / "hidden" / "v"
    _write(version_dir, "shard-00000", SAMPLES[:2])
    _write(version_dir, "shard-00001", SAMPLES[2:])
    path = shard_path(version_dir, "shard-00001")
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # one flipped bit: same size, so "complete" by size
    path.write_bytes(bytes(data))
    plan = SimpleNamespace(
        version="v",
        version_dir=version_dir,
        shards=[SimpleNamespace(key="shard-00000"), SimpleNamespace(key="shard-00001")],
    )
    monkeypatch.setattr(train_stage, "load_plan", lambda path: plan)
    profile = load_profile("micro", overrides={"run_root": str(tmp_path / "run")})
    with pytest.raises(ShardCorruptError) as err:
        train_stage.prepare_training(
            TrainSettings.from_profile(profile), ArtifactLayout.from_profile(profile), plan_path=tmp_path / "plan.json"
        )
    assert "shard-00001" in str(err.value) and "sha256" in str(err.value)
    assert "shard-00000" not in str(err.value)
    assert not list((tmp_path / "run").rglob("job.json"))  # nothing launched


V, H, DV, T = 48, 16, 24, 10


class _Samples:
    """In-memory hidden states; sample `bad` carries a NaN in its aux hidden states."""

    def __init__(self, n: int, bad: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            aux = torch.randn(T, 3 * H, generator=g)
            if i == bad:
                aux[0, 0] = float("nan")
            self.items.append(
                {
                    "input_ids": torch.randint(0, V, (T,), generator=g),
                    "loss_mask": torch.ones(T, dtype=torch.long),
                    "aux_hidden": aux,
                    "last_hidden": torch.randn(T, H, generator=g),
                    "sample_id": f"ds/conv{i}/0",
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def lengths(self) -> list[int]:
        return [T] * len(self.items)


def test_a_non_finite_loss_stops_training_at_that_step_naming_the_batch_samples(tmp_path):
    torch.manual_seed(0)
    cfg = DrafterConfig(
        target_hidden_size=H,
        hidden_size=H,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=DV,
        aux_layers=(1, 2, 3),
    )
    keep = torch.arange(0, V, 2)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    drafter = Eagle3Drafter(cfg, torch.randn(V, H), keep - torch.arange(DV), t2d)
    objective = TTTObjective(drafter, torch.randn(V, H), ttt_steps=2)
    dataset = _Samples(12, bad=7)
    sampler = BucketedSampler(dataset.lengths(), batch_tokens=2 * T, rank=0, world_size=1, seed=0)
    ckpt = Checkpointer(tmp_path / "ckpt", every=1, rank=0)
    trainer = Trainer(
        objective,
        drafter,
        dataset,
        sampler,
        LoopConfig(ttt_steps=2, lr=1e-2, total_steps=6, warmup_steps=1, grad_accum=1, grad_clip=1.0),
        ckpt,
        torch.device("cpu"),
    )
    with pytest.raises(NonFiniteTrainingError) as err:
        trainer.train()
    step = len(trainer.history.steps) + 1  # the steps before it went through
    message = str(err.value)
    assert f"step {step}" in message and "ds/conv7/0" in message
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == [
        f"step_{s:07d}" for s in range(max(1, step - 2), step)
    ]  # none of the bad step (two kept)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())  # the bad step was not applied


def test_a_cut_off_checkpoint_state_is_an_error_naming_its_file(tmp_path):
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    ckpt = Checkpointer(tmp_path / "ckpt", every=1, rank=0)
    saved = ckpt.save(1, model_state={"w": weight}, optimizer=optimizer, scheduler=scheduler, trainer_state={})
    state = saved / "trainer_state.json"
    state.write_bytes(state.read_bytes()[:20])  # cut off, as a torn copy leaves it
    model = torch.nn.Module()
    model.w = weight
    with pytest.raises(ValueError) as err:
        ckpt.load(ckpt.latest(), model=model, optimizer=optimizer, scheduler=scheduler, device=torch.device("cpu"))
    assert str(err.value).startswith(f"{state}: not valid JSON (20 bytes;")
