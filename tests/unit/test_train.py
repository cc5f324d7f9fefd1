"""Drafter training end to end under torchrun (2 CPU ranks, gloo): it learns, and a killed run resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_dagster.config import DrafterOverrides
from eagle3_dagster.config import TrainConfig
from eagle3_dagster.drafter.export import check_export
from eagle3_dagster.hidden.sharding import shard_key
from eagle3_dagster.hidden.shards import ShardFormat, ShardWriter
from eagle3_dagster.train import TrainJobConfig, build_torchrun_command
from eagle3_dagster.train.data import collate, split_heldout
from tests.tiny_deepseek import HIDDEN, LAYERS, VOCAB, tiny_deepseek_v3_config
from eagle3_dagster.train.schedule import (
    BucketedSampler,
    eval_batches,
    is_heldout_sample,
    plan_epoch,
    train_schedule,
)

DRAFT_VOCAB = 64
SAMPLES_PER_SHARD = 16


def _markov_tokens(g: torch.Generator, n: int) -> torch.Tensor:
    """Mostly-deterministic token chains, so the target's next-token behaviour is learnable from context."""
    out = [int(torch.randint(0, VOCAB, (1,), generator=g))]
    for _ in range(n - 1):
        nxt = (
            (7 * out[-1] + 3) % VOCAB
            if torch.rand(1, generator=g) < 0.85
            else int(torch.randint(0, VOCAB, (1,), generator=g))
        )
        out.append(nxt)
    return torch.tensor(out)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    from transformers import DeepseekV3ForCausalLM

    root = tmp_path_factory.mktemp("train")
    torch.manual_seed(0)
    cfg = tiny_deepseek_v3_config(kv_lora_rank=8)
    target = DeepseekV3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    # a brief pre-training makes the target a (small) language model of the chains: peaked, learnable teachers
    opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    for _ in range(60):
        batch = torch.stack([_markov_tokens(g, 32) for _ in range(8)])
        loss = target(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.eval().save_pretrained(root / "target")

    # Real shards (ShardWriter), read by the workers through the real HiddenStatesDataset.
    samples = []
    for i in range(64):
        n = int(torch.randint(12, 40, (1,), generator=g))
        ids = _markov_tokens(g, n)
        with torch.no_grad():
            hs = target(ids[None], output_hidden_states=True).hidden_states
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[n // 3 :] = 1
        samples.append((f"chains/{i}", ids, mask, torch.cat([hs[1][0], hs[2][0], hs[3][0]], -1), hs[LAYERS][0]))
    data = root / "hidden" / "v1"
    fmt = ShardFormat(
        hidden_size=HIDDEN, dtype="float32", aux_layers=(1, 2, 3), target_identity="chains", code_version="test"
    )
    for index, first in enumerate(range(0, len(samples), SAMPLES_PER_SHARD)):
        chunk = samples[first : first + SAMPLES_PER_SHARD]
        with ShardWriter(
            data, shard_key(index), fmt, [c[0] for c in chunk], [len(c[1]) for c in chunk], first_record=first
        ) as w:
            for sid, ids, mask, aux, last in chunk:
                w.write_sample(sid, input_ids=ids, loss_mask=mask, aux_hidden=aux, last_hidden=last)
    token_ids = torch.cat([c[1] for c in samples])

    counts = torch.bincount(token_ids, minlength=VOCAB)
    keep = torch.sort(torch.topk(counts, DRAFT_VOCAB).indices).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[keep] = True
    save_file({"d2t": keep - torch.arange(DRAFT_VOCAB), "t2d": t2d}, str(root / "vocab.safetensors"))
    return root


TRAIN = dict(
    ttt_steps=2,
    epochs=1,
    max_steps=24,
    lr=1e-2,
    warmup_ratio=0.1,
    batch_tokens=96,
    grad_accum=1,
    grad_clip=0.5,
    checkpoint_every=8,
    seed=0,
    nproc_per_node=2,
    backend="gloo",
    eval_fraction=0.2,
)


def train_job(ws: Path, out: str, drafter: DrafterOverrides, train: dict | None = None, **job) -> Path:
    """A job over the workspace's shards, target and vocabulary, out to `ws/out`: TRAIN updated with `train`,
    `job` the TrainJobConfig fields beyond those (also tests/unit/test_mla_end_to_end.py's MLA jobs)."""
    config = TrainJobConfig(
        hidden_version_dir=str(ws / "hidden" / "v1"),
        target_dir=str(ws / "target"),
        vocab_mapping=str(ws / "vocab.safetensors"),
        out_dir=str(ws / out),
        serving_context=512,
        train=TrainConfig(**(TRAIN | (train or {}))),
        drafter=drafter,
        export_dtype="float32",
        eval_batches=4,
        **job,
    )
    return config.write(ws / f"{out}.json")


def _job(ws: Path, out: str, **train) -> Path:
    drafter = DrafterOverrides(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    return train_job(ws, out, drafter, train, metadata={"test": True})


def _torchrun(
    ws: Path, cfg_path: Path, *worker_args: str, rdzv_endpoint: str | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = build_torchrun_command(cfg_path, nproc_per_node=2, nnodes=1, rdzv_endpoint=rdzv_endpoint) + list(worker_args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _why(proc: subprocess.CompletedProcess) -> str:
    """The first worker traceback, not torchrun's summary."""
    at = proc.stderr.find("Traceback")
    return proc.stderr[at : at + 4000] if at >= 0 else proc.stderr[-4000:]


@pytest.fixture(scope="module")
def uninterrupted(workspace) -> Path:
    proc = _torchrun(workspace, _job(workspace, "run_a"))
    assert proc.returncode == 0, _why(proc)
    assert "FutureWarning" not in proc.stderr, proc.stderr[-2000:]  # every run's log read it (DDP's broadcast_buffers)
    return workspace / "run_a"


@pytest.mark.slow  # torchrun, 2 ranks
def test_two_rank_gloo_training_lowers_loss_and_beats_untrained_drafter_on_acc0(uninterrupted):
    m = json.loads((uninterrupted / "metrics.json").read_text())
    before, after = m["initial_eval"], m["final_eval"]
    assert m["steps"] == 24
    # measured on the held-out samples, every one of them once over the two ranks
    held = [sid for sid in (f"chains/{i}" for i in range(64)) if is_heldout_sample(sid, 0.2)]
    assert after["scope"] == before["scope"] == "heldout" and after["num_samples"] == len(held) > 5
    assert after["loss"] < 0.8 * before["loss"], (before["loss"], after["loss"])
    # the untrained lm_head agrees with the teacher at chance (~1/64); 24 steps of training must add 0.25
    assert after["acc_0"] >= before["acc_0"] + 0.25, (before["acc_0"], after["acc_0"])
    assert m["final"]["sim_accept_length"] == pytest.approx(1 + after["acc_0"] + after["acc_0"] * after["acc_1"])
    assert len(m["curves"]["loss"]) == 24 and m["tokens_per_s"] > 0
    assert (uninterrupted / "curves.png").stat().st_size > 1000
    assert check_export(uninterrupted / "export").ok


@pytest.mark.slow  # torchrun twice
def test_resume_after_kill_ends_with_identical_parameters(workspace, uninterrupted):
    cfg = _job(workspace, "run_b")
    crashed = _torchrun(workspace, cfg, "--stop-after-step", "12")
    assert crashed.returncode != 0  # os._exit after step 12; last checkpoint is step 8
    assert (workspace / "run_b" / "ckpt" / "latest").read_text() == "step_0000008"
    assert not (workspace / "run_b" / "metrics.json").exists()
    resumed = _torchrun(workspace, cfg)
    assert resumed.returncode == 0, _why(resumed)
    a = load_file(str(uninterrupted / "ckpt" / "step_0000024" / "model.safetensors"))
    b = load_file(str(workspace / "run_b" / "ckpt" / "step_0000024" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    curves_a = json.loads((uninterrupted / "metrics.json").read_text())["curves"]["loss"]
    curves_b = json.loads((workspace / "run_b" / "metrics.json").read_text())["curves"]["loss"]
    assert curves_a == curves_b


def test_epoch_plan_respects_token_budget_and_splits_evenly_across_ranks():
    lengths = [5, 9, 30, 31, 7, 12, 64, 3, 17, 22, 8]
    batches = plan_epoch(lengths, batch_tokens=40, seed=0, epoch=0, world_size=2)
    assert len(batches) % 2 == 0
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 40
    assert plan_epoch(lengths, 40, 0, 0, 2) == batches and plan_epoch(lengths, 40, 0, 1, 2) != batches


def test_heldout_samples_are_chosen_by_id_alone_and_never_reach_a_training_batch():
    ids = [f"ds/{i}" for i in range(400)]
    lengths = [3 + i % 37 for i in range(400)]

    class Samples:
        def __len__(self):
            return len(ids)

        def lengths(self):
            return lengths

    train, held = split_heldout(Samples(), ids, 0.1)
    held_ids = {ids[i] for i in held.indices}
    assert 20 <= len(held_ids) <= 60  # ~10 %
    # the same samples whatever the order, seed or neighbours: a pure function of the id
    assert {sid for sid in reversed(ids) if is_heldout_sample(sid, 0.1)} == held_ids
    assert not any(is_heldout_sample(sid, 0.0) for sid in ids)
    assert held.lengths() == [lengths[i] for i in held.indices]
    for rank in (0, 1):  # every batch either rank trains on, over three epochs, indexes the training subset
        sampler = BucketedSampler(train.lengths(), batch_tokens=64, rank=rank, world_size=2, seed=5)
        seen = {ids[train.indices[i]] for _ in range(3 * len(sampler)) for i in sampler.next_batch()}
        assert not seen & held_ids
    # evaluation sees each held-out sample exactly once across ranks, within the token budget
    plans = [eval_batches(held.lengths(), 64, rank, 2) for rank in (0, 1)]
    flat = sorted(i for plan in plans for b in plan for i in b)
    assert flat == list(range(len(held_ids)))
    assert all(len(b) == 1 or max(held.lengths()[i] for i in b) * len(b) <= 64 for plan in plans for b in plan)


def test_schedule_counts_steps_and_tokens_per_step_the_way_the_worker_trains():
    ids = [f"ds/{i}" for i in range(300)]
    lengths = [10 + (7 * i) % 90 for i in range(300)]
    cfg = TrainConfig(batch_tokens=256, grad_accum=2, epochs=3, warmup_ratio=0.1, eval_fraction=0.05)
    sched = train_schedule(lengths, ids, cfg, world_size=2)
    kept = [n for n, sid in zip(lengths, ids) if not is_heldout_sample(sid, 0.05)]
    batches = plan_epoch(kept, 256, cfg.seed, 0, 2)
    assert sched.num_train_samples == len(kept) and sched.num_heldout_samples == 300 - len(kept)
    assert sched.steps_per_epoch == len(batches) // 2 // 2 and sched.total_steps == 3 * sched.steps_per_epoch
    assert sched.warmup_steps == -(-sched.total_steps // 10)
    assert sched.tokens_per_step == pytest.approx(sum(kept[i] for b in batches for i in b) / sched.steps_per_epoch)
    assert sched.tokens_per_step <= 2 * 2 * 256
    assert train_schedule(lengths, ids, cfg.model_copy(update={"max_steps": 7}), 2).total_steps == 7


def test_restored_sampler_yields_identical_batches():
    lengths = list(range(3, 40))
    s = BucketedSampler(lengths, batch_tokens=60, rank=1, world_size=2, seed=3)
    for _ in range(len(s) + 2):  # crosses an epoch boundary
        s.next_batch()
    state = s.state_dict()
    expected = [s.next_batch() for _ in range(5)]
    r = BucketedSampler(lengths, batch_tokens=60, rank=1, world_size=2, seed=3)
    r.load_state_dict(state)
    assert [r.next_batch() for _ in range(5)] == expected


def test_collate_right_pads_and_names_bad_sample():
    good = {
        "input_ids": torch.tensor([1, 2, 3]),
        "loss_mask": torch.tensor([0, 1, 1]),
        "aux_hidden": torch.ones(3, 6),
        "last_hidden": torch.ones(3, 2),
        "sample_id": "ok",
    }
    short = {
        **good,
        "input_ids": torch.tensor([4]),
        "loss_mask": torch.tensor([1]),
        "aux_hidden": torch.ones(1, 6),
        "last_hidden": torch.ones(1, 2),
        "sample_id": "short",
    }
    batch = collate([good, short], [0, 1])
    assert batch.input_ids_BT.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch.loss_mask_BT.tolist() == [[0, 1, 1], [1, 0, 0]] and batch.num_tokens == 4
    bad = {**good, "last_hidden": torch.ones(2, 2), "sample_id": "broken-7"}
    with pytest.raises(ValueError, match="broken-7"):
        collate([bad], [0])


def test_torchrun_command_runs_the_engine_module_with_the_job_file(tmp_path):
    cmd = build_torchrun_command(
        tmp_path / "job.json",
        nproc_per_node=8,
        nnodes=2,
        python="/opt/py",
        rdzv_endpoint="h0:29500",
        extra_args=["--max-restarts=0"],
    )
    assert cmd[:3] == ["/opt/py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=8" in cmd and "--nnodes=2" in cmd and "--standalone" not in cmd
    assert cmd.index("--max-restarts=0") < cmd.index("-m", 3)  # torchrun's own arguments come before the module
    assert cmd[-4:] == ["-m", "eagle3_dagster.train", "--config", str(tmp_path / "job.json")]
    job = TrainJobConfig(
        hidden_version_dir="h",
        target_dir="t",
        vocab_mapping="v",
        out_dir="o",
        serving_context=8192,
        aux_layers=(2, 30, 58),
    )
    assert TrainJobConfig.from_json(job.to_json()) == job
    assert build_torchrun_command(Path("j.json"), 2)[0] == sys.executable


def test_multi_node_command_joins_a_c10d_rendezvous_and_needs_an_endpoint(tmp_path):
    cmd = build_torchrun_command(
        tmp_path / "job.json",
        nproc_per_node=8,
        nnodes=2,
        python="/opt/py",
        rdzv_endpoint="node0:29500",
        rdzv_id="run-1",
    )
    assert cmd[:5] == ["/opt/py", "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2"]
    assert cmd[5:8] == ["--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=run-1"]
    assert "--standalone" not in cmd
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        build_torchrun_command(tmp_path / "job.json", nproc_per_node=8, nnodes=2)
    from eagle3_dagster.config import ProfileError, load_profile

    # unset, drafter_checkpoint derives it from the first leased host (tests/unit/test_multi_node_training.py)
    assert load_profile("production", {"train": {"nnodes": 2}}).train.rdzv_endpoint is None
    assert load_profile("production", {"train": {"nnodes": 2, "rdzv_endpoint": "gpu-host-0:29500"}}).train.nnodes == 2
    with pytest.raises(ProfileError, match="train.rdzv_endpoint: expected host:port"):
        load_profile("production", {"train": {"nnodes": 2, "rdzv_endpoint": "gpu-host-0"}})


@pytest.mark.slow  # torchrun with a c10d rendezvous
def test_single_node_run_through_the_c10d_rendezvous_backend_trains(workspace):
    from tests.sshd_server import free_port

    proc = _torchrun(workspace, _job(workspace, "run_rdzv", max_steps=4), rdzv_endpoint=f"127.0.0.1:{free_port()}")
    assert proc.returncode == 0, _why(proc)
    metrics = json.loads((workspace / "run_rdzv" / "metrics.json").read_text())
    assert metrics["steps"] == 4
