"""The `specforge` row of benchmarks/drafter_quality.py: SpecForge's own trainer on the same shards, measured our way.

Owns running SpecForge 0.2.0 (its PyPI release, `specforge train` and `specforge export --to sglang`, unchanged)
on the profile's hidden-state version and handing its drafter to the measurements the other rows get. The table,
the in-process benchmark (`Acceptance`) and the variants are drafter_quality.py's.

One run, per seed, in `<run_root>/specforge/run-<hash>/` (a finished run is read back, not trained again):

1. Data. The version is exported once to SpecForge's layout (`export_specforge`, what `eagle3 export-shards
   --format specforge` writes, bfloat16 as SpecForge computes) under `<run_root>/specforge/features-<version>/all`,
   and `.../train-<eval_fraction>` gets a hard link to every sample our training trains on and to no other
   (`link_training_samples`): the samples `train.eval_fraction` holds out (chosen by sample id,
   `train.data.split_heldout`, the split the training worker makes) are not there, and SpecForge reads every
   `.ckpt` below the folder it is given, so it never sees them.
2. Recipe. The profile's epochs, lr, TTT length (`train.ttt_steps`) and max length (`data.max_seq_len`), one
   sample per rank and optimizer step (`training.batch_size: 1`) on `train.nproc_per_node` ranks, the profile's
   seed; SpecForge's own defaults for everything else (warm-up 1.5 %, cosine, grad norm 0.5, its optimizer,
   bfloat16). The draft is the plain EAGLE-3 drafter the other rows' plain variants train (`PLAIN`: SpecForge
   0.2.0 trains no EAGLE 3.1 norms), in its LlamaForCausalLMEagle3 config, over the profile's draft vocabulary
   (`vocab_mapping`, handed over as SpecForge's `{d2t, t2d}` file), so both are scored on the same positions.
3. CPU. Three settings of SpecForge's own config make its released trainer run on CPU with gloo:
   `training.fsdp_sharding: NO_SHARD` (its DDP path; torch refuses FSDP without an accelerator),
   `training.attention_backend: sdpa` (FlexAttention has no backward on CPU), `SPECFORGE_DEVICE=cpu`; and one
   shim, `specforge_cpu/sitecustomize.py`: its KL loss is a Triton kernel, replaced by the reference formula
   the same file keeps (nothing else of SpecForge changes).
4. Measurement. Training CPU seconds are the rusage of the `specforge train` process tree (torchrun, ranks, data
   loader workers), as `train_variant` counts torchrun's. The export is loaded by `load_drafter` (the benchmark's
   reader of foreign drafters) and scored by the training job's own evaluator (`Trainer.evaluate` over the
   held-out samples: acc_0..acc_k, simulated acceptance); drafter_quality.py then runs the in-process benchmark
   on `run_dir/export`.

SpecForge runs in its own venv, `.cache/specforge-venv/<version>/`, built on first use (`specforge_python`): this
project's environment (CPU torch 2.13.0, numpy, safetensors) on its path after the venv's own packages, the pure
Python packages its trainer imports at SpecForge's pins where it pins them (`REQUIREMENTS`), and the release wheel,
checked against PyPI's sha256 (tests/release_wheels.py) and installed without its dependencies (torch 2.11,
sglang, yunchang, wandb: nothing the offline trainer imports on CPU).

    python benchmarks/specforge_variant.py [--profile demo] [--seed 0] [--max-steps N]
        # one run and its held-out figures, without the benchmark; --max-steps: a short check (SpecForge's
        # training.max_steps), with the seconds per optimizer step and the full recipe's extrapolated wall time
    python benchmarks/drafter_quality.py --variants profile,specforge   # the row beside the others
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

NAME = "specforge"
VERSION = "0.2.0"
# What SpecForge 0.2.0 trains: a plain EAGLE-3 drafter (drafter_quality.PLAIN_DRAFTER). As a variant's overrides,
# it makes the profile the row is described by (draft KV size, the drafter's shape); the recipe is the profile's.
PLAIN = {"attention": "gqa", "fc_norm": False, "norm_output": False}
OVERRIDES = {"drafter": PLAIN}
SHIM = Path(__file__).resolve().parent / "specforge_cpu"
VENV_ROOT = ROOT / ".cache" / "specforge-venv"
# The packages SpecForge's offline trainer and exporter import that this project's environment lacks or has at
# another release, pinned. transformers, and the huggingface-hub and tokenizers it needs, at SpecForge's own pin
# (transformers==5.8.1); kernels inside transformers 5.8.1's own range (its `kernels` extra, <0.13: the project's
# newer one raises at transformers' import); accelerate (`specforge.cli` seeds with it) and psutil, its dependency.
REQUIREMENTS = (
    "transformers==5.8.1",
    "huggingface_hub==1.33.0",
    "tokenizers==0.22.2",
    "kernels==0.12.3",
    "accelerate==1.15.0",
    "psutil==7.2.2",
)
RECIPE = 1  # bump when specforge_python installs something differently


# ---------------------------------------------------------------------------------------------------- the venv


def specforge_python(log=print) -> Path:
    """The interpreter of SpecForge's venv, built (or rebuilt, when its inputs changed) under a lock."""
    import sysconfig

    from tests.release_wheels import hashed_requirement, wheel

    target = VENV_ROOT / VERSION
    python = target / "bin" / "python"
    base = Path(sysconfig.get_paths()["purelib"])
    digest = hashlib.sha256(json.dumps([RECIPE, VERSION, REQUIREMENTS, str(base)]).encode()).hexdigest()
    stamp = target / ".eagle3-stamp"
    VENV_ROOT.mkdir(parents=True, exist_ok=True)
    with open(VENV_ROOT / f".{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == digest and python.exists():
            return python
        release = wheel("specforge", VERSION)  # checked against PyPI's sha256 before anything is removed
        started = time.monotonic()
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
        site = Path(sysconfig.get_path("purelib", vars={"base": str(target), "platbase": str(target)}))
        if target not in site.parents:
            raise RuntimeError(f"{site} is not inside the venv {target}")
        # the project's environment after the venv's own packages: the venv's pins win, torch is the project's
        (site / "eagle3_base.pth").write_text(f"import site; site.addsitedir({str(base)!r})\n")
        pip = [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "--disable-pip-version-check",
            "-q",
            "install",
            "-c",
            str(ROOT / "constraints.txt"),
        ]
        subprocess.run([*pip, *REQUIREMENTS], check=True)
        hashed = target / "specforge-wheel.txt"  # pip's hash-checking mode: the file must have PyPI's sha256
        hashed.write_text(hashed_requirement("specforge", VERSION, spec=str(release)) + "\n")
        subprocess.run([*pip, "--no-deps", "--require-hashes", "-r", str(hashed)], check=True)
        stamp.write_text(digest)
        log(f"SpecForge {VERSION} venv built in {time.monotonic() - started:.0f} s at {target}")
    return python


# ---------------------------------------------------------------------------------------------------- the data


def link_training_samples(export_dir: Path, out_dir: Path, eval_fraction: float) -> tuple[list[str], list[str]]:
    """`out_dir` (made afresh) with a hard link to each sample of the SpecForge export `export_dir` that our training
    trains on, under the export's own file name; returns (sample ids linked, sample ids held out).

    Which samples are held out is `split_heldout` over the export's sample ids (its marker lists them in file
    order), the split the training worker makes over the same version's samples."""
    from eagle3_dagster.hidden.export_formats import EXPORT_MARKER, specforge_path
    from eagle3_dagster.train.data import split_heldout

    marker = json.loads((Path(export_dir) / EXPORT_MARKER).read_text())
    if marker.get("layout") != "specforge" or not marker.get("complete"):
        raise ValueError(f"{export_dir}: not a complete SpecForge export of this project ({EXPORT_MARKER})")
    ids = list(marker["sample_ids"])
    train, heldout = split_heldout(ids, ids, eval_fraction)
    shutil.rmtree(out_dir, ignore_errors=True)
    for i in train.indices:
        dst = specforge_path(out_dir, i)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(specforge_path(export_dir, i), dst)
    return [ids[i] for i in train.indices], [ids[i] for i in heldout.indices]


def training_features(plan, root: Path, eval_fraction: float, log) -> tuple[Path, list[str], list[str]]:
    """(folder SpecForge trains from, sample ids in it, sample ids held out) for the plan's version."""
    from eagle3_dagster.hidden.export_formats import EXPORT_MARKER, export_specforge

    base = root / f"features-{plan.version}"
    everything = base / "all"
    marker = everything / EXPORT_MARKER
    if not (marker.exists() and json.loads(marker.read_text()).get("complete")):
        log(f"    exporting {plan.version_dir} to SpecForge's layout in {everything}")
        export_specforge(plan.version_dir, everything)
    train_dir = base / f"train-{eval_fraction:g}"
    train_ids, heldout_ids = link_training_samples(everything, train_dir, eval_fraction)
    return train_dir, train_ids, heldout_ids


# ---------------------------------------------------------------------------------------------------- the run


def draft_config(profile, plan, draft_vocab_size: int) -> dict:
    """The LlamaForCausalLMEagle3 config SpecForge builds its draft from: the shape of our plain drafter."""
    from eagle3_dagster.config import DrafterOverrides
    from eagle3_dagster.drafter.model import DrafterConfig
    from eagle3_dagster.drafter.target_head import TargetArch

    overrides = DrafterOverrides.model_validate({**profile.drafter.model_dump(), **PLAIN})
    c = DrafterConfig.from_profile(
        overrides,
        TargetArch.from_dir(plan.target.path),
        draft_vocab_size=draft_vocab_size,
        aux_layers=plan.target.aux_layers,
        serving_context=profile.target.serving_context,
    )
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        # SGLang's output numbering (canonical - 1, eagle3_dagster/layers.py), read back by load_drafter, which
        # the evaluation checks against the shards' layers
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layers],
            "use_aux_hidden_state": True,
        },
    }


def run_config(
    profile, *, features: Path, target: Path, draft: Path, vocab: Path, out: Path, max_steps: int | None
) -> dict:
    """SpecForge's run config (`specforge/config/schema.py`): the profile's recipe, SpecForge's defaults elsewhere."""
    t = profile.train
    training = {
        "num_epochs": t.epochs,
        "learning_rate": t.lr,
        "ttt_length": t.ttt_steps,
        "batch_size": 1,
        "accumulation_steps": t.grad_accum,
        "seed": t.seed,
        "log_interval": 10,
        "fsdp_sharding": "NO_SHARD",
        "attention_backend": "sdpa",  # its CPU path (module docstring)
    }
    if max_steps:
        training["max_steps"] = max_steps
    return {
        "model": {"target_model_path": str(target), "draft_model_config": str(draft), "vocab_mapping_path": str(vocab)},
        "data": {
            "hidden_states_path": str(features),
            "max_length": profile.data.max_seq_len,
            "cache_dir": str(out / "cache"),
        },
        "training": training,
        "deployment": {"trainer": {"nproc_per_node": t.nproc_per_node}},
        "output_dir": str(out / "output"),
        "run_id": NAME,
    }


def _env(nproc: int) -> dict[str, str]:
    import torch

    from eagle3_dagster.threads import thread_env

    env = {
        **os.environ,
        **thread_env(nproc),
        "PYTHONPATH": str(SHIM),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    if not torch.cuda.is_available():
        env["SPECFORGE_DEVICE"] = "cpu"
    return env


def _latest_checkpoint(output_dir: Path) -> tuple[Path, int]:
    """SpecForge's final checkpoint (`<run_id>-step<N>`, the newest step) and its optimizer step."""
    found = [
        (int(m.group(1)), p)
        for p in output_dir.glob(f"{NAME}-step*")
        if (m := re.fullmatch(rf"{NAME}-step(\d+)", p.name)) and (p / "training_state.pt").exists()
    ]
    if not found:
        raise RuntimeError(f"{output_dir}: SpecForge wrote no checkpoint")
    step, path = max(found)
    return path, step


def train_specforge(profile, layout, plan_path, log, *, max_steps: int | None = None) -> dict:
    """Train (or read back) SpecForge's drafter; returns what `train_variant` returns for our runs (metrics.json's
    `final_eval` and `steps`, `tokens_seen`, the CPU seconds of its process tree, `run_dir` holding `export/`)."""
    import torch
    from safetensors.torch import load_file

    from eagle3_dagster.hidden.extraction_plan import load_plan
    from eagle3_dagster.hidden.export_formats import specforge_target_dir
    from eagle3_dagster.io import atomic_write_json
    from eagle3_dagster.storage import read_json

    plan = load_plan(plan_path)
    root = Path(layout.run_root) / NAME
    features, train_ids, heldout_ids = training_features(plan, root, profile.train.eval_fraction, log)
    mapping = load_file(str(layout.vocab_mapping))
    draft = draft_config(profile, plan, int(mapping["d2t"].shape[0]))
    key = {
        "specforge": VERSION,
        "recipe": RECIPE,
        "hidden_version": plan.version,
        "draft": draft,
        "vocab_mapping": hashlib.sha256(layout.vocab_mapping.read_bytes()).hexdigest(),
        "train": profile.train.model_dump(mode="json"),
        "max_length": profile.data.max_seq_len,
        "max_steps": max_steps,
    }
    run_dir = root / f"run-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"
    metrics_path = run_dir / "metrics.json"
    if metrics_path.exists():
        log(f"    reusing {run_dir}")
        return read_json(metrics_path) | {"run_dir": str(run_dir)}

    python = specforge_python(log)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "key.json", key)
    atomic_write_json(run_dir / "draft_config.json", draft)
    vocab = run_dir / "vocab_mapping.pt"  # SpecForge's format: torch.save({"d2t", "t2d"}), same meaning as ours
    torch.save({"d2t": mapping["d2t"], "t2d": mapping["t2d"]}, vocab)
    target = specforge_target_dir(plan.target.path, root)  # TargetHead wants a *.index.json beside the weights
    shutil.rmtree(run_dir / "output", ignore_errors=True)  # a killed run's checkpoints: start it afresh
    config = run_config(
        profile,
        features=features,
        target=target,
        draft=run_dir / "draft_config.json",
        vocab=vocab,
        out=run_dir,
        max_steps=max_steps,
    )
    atomic_write_json(run_dir / "run_config.json", config)
    env = _env(profile.train.nproc_per_node)

    log(f"    specforge train: {len(train_ids)} samples ({len(heldout_ids)} held out), log {run_dir / 'train.log'}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with open(run_dir / "train.log", "w") as out:
        proc = subprocess.run(
            [str(python), "-m", "specforge.cli", "train", "--config", str(run_dir / "run_config.json")],
            env=env,
            cwd=run_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"specforge train exited {proc.returncode}; see {run_dir / 'train.log'}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    checkpoint, steps = _latest_checkpoint(run_dir / "output")

    export_dir = run_dir / "export"
    shutil.rmtree(export_dir, ignore_errors=True)
    with open(run_dir / "export.log", "w") as out:
        subprocess.run(
            [
                str(python),
                "-m",
                "specforge.cli",
                "export",
                "--to",
                "sglang",
                "--checkpoint",
                str(checkpoint),
                "--draft-config",
                str(run_dir / "draft_config.json"),
                "--output-dir",
                str(export_dir),
                "--vocab-mapping",
                str(vocab),
            ],
            env=env,
            cwd=run_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )

    final = heldout_eval(profile, plan, export_dir)
    if final["num_samples"] != len(heldout_ids):
        raise RuntimeError(
            f"held-out evaluation scored {final['num_samples']} samples, {len(heldout_ids)} were held out"
        )
    lengths = _train_lengths(plan, set(train_ids), profile.data.max_seq_len)
    # SpecForge reports no token count: each training sample once per epoch, as its sampler deals them
    epochs = profile.train.epochs if not max_steps else steps * profile.train.nproc_per_node / max(len(lengths), 1)
    metrics = {
        "variant": NAME,
        "specforge_version": VERSION,
        "final_eval": final,
        "steps": steps,
        "tokens_seen": round(sum(lengths) * epochs),
        "train_cpu_s": round(cpu, 1),
        "train_wall_s": round(wall, 1),
        "load_avg_1m": os.getloadavg()[0],
        "wall_s_per_step": round(wall / max(steps, 1), 4),
        "steady_s_per_step": steady_step_seconds(run_dir / "train.log"),
        "num_train_samples": len(train_ids),
        "num_heldout_samples": len(heldout_ids),
        "features": str(features),
        "checkpoint": str(checkpoint),
        "max_steps": max_steps,
    }
    atomic_write_json(metrics_path, metrics)
    return metrics | {"run_dir": str(run_dir)}


def steady_step_seconds(log_path: Path) -> float | None:
    """The median of SpecForge's own `perf/optimizer_step_time_s` (the mean over each logging interval) over the
    intervals after its first (whose steps compile its torch.compile'd functions), or None without two intervals."""
    import statistics

    times = {}  # both ranks log each interval
    for line in Path(log_path).read_text(errors="replace").splitlines():
        m = re.match(r"step (\d+): .*'perf/optimizer_step_time_s': ([0-9.e+-]+)", line)
        if m:
            times[int(m.group(1))] = float(m.group(2))
    later = [t for step, t in sorted(times.items())[1:]]
    return statistics.median(later) if later else None


def _train_lengths(plan, train_ids: set[str], max_length: int) -> list[int]:
    from eagle3_dagster.hidden.dataset import HiddenStatesDataset

    ds = HiddenStatesDataset(plan.version_dir)
    return [min(n, max_length) for sid, n in zip(ds.sample_ids, ds.lengths()) if sid in train_ids]


# ---------------------------------------------------------------------------------------------------- the score


def heldout_eval(profile, plan, export_dir: Path) -> dict:
    """The training job's final evaluation (`Trainer.evaluate` over the held-out samples of `split_heldout`), of
    the drafter in `export_dir` as the benchmark loads it; one process (the job splits the same batches over its
    ranks and sums the same counts)."""
    import torch

    from eagle3_dagster.drafter.imported import load_any_drafter
    from eagle3_dagster.drafter.target_head import load_target_tensors
    from eagle3_dagster.hidden.dataset import HiddenStatesDataset
    from eagle3_dagster.train.checkpoint import Checkpointer
    from eagle3_dagster.train.data import split_heldout
    from eagle3_dagster.train.loop import LoopConfig, Trainer, TTTObjective
    from eagle3_dagster.train.schedule import BucketedSampler

    imported = load_any_drafter(export_dir, plan.target.path)
    if tuple(imported.aux_layers) != tuple(plan.target.aux_layers):
        raise RuntimeError(
            f"{export_dir}: the drafter reads aux layers {imported.aux_layers} "
            f"({imported.aux_layers_from}), the shards hold {plan.target.aux_layers}"
        )
    drafter = imported.model.float().eval()
    t = profile.train
    dataset = HiddenStatesDataset(plan.version_dir)
    train_set, heldout = split_heldout(dataset, dataset.sample_ids, t.eval_fraction)
    if not len(heldout):
        raise ValueError("train.eval_fraction holds out no sample: nothing to evaluate on")
    lm_head = load_target_tensors(Path(plan.target.path), want=("lm_head",)).lm_head
    objective = TTTObjective(drafter, lm_head.float(), t.ttt_steps)
    sampler = BucketedSampler(train_set.lengths(), t.batch_tokens, 0, 1, t.seed)
    cfg = LoopConfig(ttt_steps=t.ttt_steps, lr=t.lr, total_steps=1, warmup_steps=1, grad_accum=1, grad_clip=t.grad_clip)
    trainer = Trainer(objective, drafter, train_set, sampler, cfg, Checkpointer(export_dir, 0, 0), torch.device("cpu"))
    with torch.no_grad():
        return trainer.evaluate(heldout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many optimizer steps (SpecForge's training.max_steps): a short check",
    )
    args = parser.parse_args()

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.hidden.extraction_plan import build_plan, load_plan, write_plan
    from eagle3_dagster.train.schedule import train_schedule
    from eagle3_dagster.hidden.dataset import HiddenStatesDataset

    base = load_profile(args.profile)
    layout = ArtifactLayout.from_profile(base)
    plan_path = write_plan(build_plan(base, layout))
    train = base.train.model_copy(update={"seed": args.seed})
    profile = base.model_copy(update={"train": type(base.train).model_validate(train.model_dump())})
    m = train_specforge(profile, layout, plan_path, lambda line: print(line, flush=True), max_steps=args.max_steps)
    held = m["final_eval"]
    accs = " ".join(f"{held[f'acc_{j}']:.3f}" for j in range(profile.train.ttt_steps))
    print(
        f"{m['steps']} steps, {m['train_wall_s']} s wall ({m['wall_s_per_step']} s per step), {m['train_cpu_s']} CPU s;"
        f" held-out ({held['num_samples']} samples, {held['num_scored_tokens']} tokens) acc {accs}, "
        f"sim. acceptance {held['sim_accept_length']:.3f}"
    )
    if args.max_steps:
        ds = HiddenStatesDataset(load_plan(plan_path).version_dir)
        full = train_schedule(ds.lengths(), ds.sample_ids, profile.train, profile.train.nproc_per_node).total_steps
        steady = m.get("steady_s_per_step") or m["wall_s_per_step"]
        overhead = m["train_wall_s"] - m["steps"] * steady  # start-up and the first steps' compilation
        print(
            f"steady state {steady:.3f} s per optimizer step; the full recipe's {full} steps: about "
            f"{(overhead + full * steady) / 3600:.2f} h of wall time at this rate"
        )


if __name__ == "__main__":
    main()
