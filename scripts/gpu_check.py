"""Device check for one CUDA machine with no network: `scripts/gpu_check.sh [--device cpu]`.

Four checks of the code paths that behave differently on a GPU, each against a reference
computed in the same run, then one table:

1. dump hook: `HiddenStateDumper` with real CUDA tensors and its pinned-buffer copies,
   captured while the stream is kept busy by queued matmuls (so the CPU is far ahead of
   the copies), both patch styles (loop and collector), host buffers reused across
   batches of different shapes; every stored tensor must equal its source exactly.
2. hf extraction: a tiny DeepSeek-V3 target built here (MLA, MoE, first layer dense),
   `extract_all_hf` on CUDA in fp32 and bf16 against CPU fp32, within fp32 / bf16 tolerance.
3. training: `torchrun` of the demo drafter for 50 steps on the CUDA extraction's shards
   (backend nccl, bf16 autocast; one rank per GPU), plus an NCCL all-reduce through torchrun.
4. the MLA drafter (`drafter.attention: mla`): trained like 3, exported as SGLang's
   `Eagle3DeepseekV2ForCausalLM` and accepted by `check_export`; the simulator drafts with its MLA
   cache on the device and gives the target's greedy output; and SGLang's own server (of
   `--sglang-python`, or this interpreter where it imports sglang) loads it beside the target and
   serves that output with the simulator's verify steps, prompt by prompt. Without SGLang the last
   row reads NOT RUN (it is not counted as passed).

`--device cpu` runs the same code on CPU (gloo, no autocast): the dry run that proves the
script end to end where there is no GPU. What the GPU machine lacks is brought as wheel
files (`scripts/gpu_check_wheels.sh` downloads them into `.whl/`); only distributions its
interpreter lacks, or has in an older version, are unpacked (into `.whl/site`).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in v.replace("-", ".").split(".")[:4])


def bring_wheels(wheels: Path = WHEELS) -> list[str]:
    """Unpack the wheels of `wheels` whose distribution is missing or older here; put them first on the path."""
    site = wheels / "site"
    unpacked = []
    this_python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for whl in sorted(wheels.glob("*.whl")):
        dist, version, python_tag = whl.name.split("-")[:3]
        if this_python not in python_tag.split(".") and not python_tag.startswith("py"):
            continue  # built for another interpreter
        try:
            have = md.version(dist)
        except md.PackageNotFoundError:
            have = None
        if have is not None and _version_key(have) >= _version_key(version):
            continue
        if not (site / f"{dist}-{version}.dist-info").exists():
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        unpacked.append(f"{dist} {version}" + (f" (over {have})" if have else ""))
    paths = [str(site)] if unpacked else []
    sys.path[:0] = [*paths, str(ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return unpacked


def demo_profile():
    from eagle3_dagster.config import load_profile_file

    return load_profile_file(ROOT / "configs" / "demo.yaml")


# -- 1. dump hook ----------------------------------------------------------------------------------------------


def check_dump_hook(device: str, work: Path) -> dict:
    import enum
    import inspect
    from types import SimpleNamespace

    import torch
    from safetensors import safe_open

    from eagle3_dagster.sglang.dump_hook import HiddenStateDumper, chunk_filename

    class ForwardMode(enum.Enum):  # SGLang's enum, by name
        EXTEND = 1

    cuda = device == "cuda"
    # CUDA: big enough that copies take real time; CPU (dry run): small enough for a laptop
    hidden, (low, high) = (2048, (200, 1500)) if cuda else (256, (20, 200))
    num_layers, layers = 6, [1, 3, 5]
    dumper = HiddenStateDumper(work / "dump", layers, rank_fn=lambda: 0)
    takes_ids = "input_ids" in inspect.signature(dumper.capture_final).parameters
    g = torch.Generator(device="cpu").manual_seed(0)
    gd = torch.Generator(device=device).manual_seed(0)  # states are made on the device: no H2D copy waits on the queue
    weights = [
        (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16) for _ in range(num_layers)
    ]
    busy = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) if cuda else None
    expected: dict[str, dict[str, torch.Tensor]] = {}
    lagging = 0
    num_batches = 8
    for b in range(num_batches):
        lengths = [int(x) for x in torch.randint(low, high, (2 + b % 3,), generator=g)]
        rids = [f"b{b}r{j}" for j in range(len(lengths))]
        if cuda:  # queue tens of milliseconds of work ahead of everything this batch computes and copies
            for _ in range(40):
                busy = torch.tanh(busy @ busy * 1e-4)
        input_ids = torch.randint(0, 32000, (sum(lengths),), generator=gd, device=device)
        batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            input_ids=input_ids,
            rids=rids,
            positions=None,
            extend_seq_lens_cpu=lengths,
            extend_prefix_lens_cpu=[0] * len(lengths),
            extend_seq_lens=torch.tensor(lengths),
            extend_prefix_lens=torch.zeros(len(lengths)),
        )
        style = "loop" if b % 2 == 0 else "collector"
        h = torch.randn(sum(lengths), hidden, generator=gd, device=device).to(torch.bfloat16)
        if cuda:
            h = h + busy[0, 0] * 0  # the states themselves come out of the busy stream
        residual = None
        refs: dict[str, torch.Tensor] = {}
        for i in range(num_layers):
            if style == "loop":
                dumper.capture_layer_input(i, h, residual, batch)
            residual = h.clone() if residual is None else residual.add_(h)  # in place, as SGLang's fused add+norm
            if style == "collector":
                collector = dumper.layer_collector(i, batch, None)
                if collector is not None:
                    collector.append(residual)
            if i in layers:
                refs[f"hidden.{i}"] = residual.clone()
            h = torch.tanh(torch.nn.functional.rms_norm(residual, (hidden,)) @ weights[i])
        final = torch.nn.functional.rms_norm(h + residual, (hidden,))
        refs["last_hidden"], refs["input_ids"] = final.clone(), input_ids.clone()
        if takes_ids:
            dumper.capture_final(final, input_ids, batch)
        else:
            dumper.capture_final(final, batch)
        if cuda:
            mark = torch.cuda.Event()
            mark.record()
            lagging += not mark.query()  # the copies just issued have not landed yet
        # overwrite the sources at once: a copy that had not been ordered before this would see it
        for source in (h, residual, final, input_ids):
            source.zero_()
        offset = 0
        for rid, n in zip(rids, lengths):
            expected[rid] = {k: v[offset : offset + n].cpu() for k, v in refs.items()}
            offset += n
    dumper.flush()
    mismatched, compared = [], 0
    for rid, ref in expected.items():
        path = work / "dump" / chunk_filename(rid, 0)
        with safe_open(str(path), framework="pt") as f:
            for name, want in ref.items():
                compared += 1
                got = f.get_tensor(name)
                if got.dtype != want.dtype or not torch.equal(got, want):
                    mismatched.append(f"{rid}/{name}")
    ok = not mismatched and (not cuda or lagging > 0)  # a first pinned allocation may synchronise once
    detail = (
        f"{len(expected)} requests, {num_batches} batches, {compared} tensors, "
        f"{len(mismatched)} differ{': ' + ', '.join(mismatched[:4]) if mismatched else ''}"
    )
    if cuda:
        detail += f"; GPU behind the CPU at {lagging}/{num_batches} captures"
    return {"check": "dump hook: stored == source", "ok": ok, "detail": detail}


# -- 2. hf extraction --------------------------------------------------------------------------------------------


def build_target(work: Path, num_samples: int) -> tuple[Path, Path, int, int]:
    import torch

    from eagle3_dagster.tiny.model import create_tiny_model, tiny_model_config

    # The demo's target architecture, randomly initialised. Every token is routed to every expert: top-k over
    # near-tied random router scores would flip between fp32 and bf16 (or CPU and CUDA) on a few tokens and
    # swamp the numeric comparison; with k = all experts the routing is continuous and the MoE code still runs.
    tiny = demo_profile().target.tiny
    cfg = tiny.model_copy(update={"num_experts_per_tok": tiny.n_routed_experts})
    target = work / "target"
    model = create_tiny_model(
        tiny_model_config(cfg, vocab_size=cfg.vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2), seed=cfg.seed
    )
    model.save_pretrained(str(target))
    g = torch.Generator().manual_seed(1)
    merged = work / "merged_train.jsonl"
    with open(merged, "w") as f:
        for k in range(num_samples):
            n = int(torch.randint(64, 512, (1,), generator=g))
            ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
            mask = [0] * (n // 4) + [1] * (n - n // 4)
            f.write(json.dumps({"id": f"s{k}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return target, merged, cfg.num_hidden_layers, cfg.vocab_size


def check_extraction(device: str, work: Path, target: Path, merged: Path, num_layers: int) -> tuple[list[dict], Path]:
    import torch

    from eagle3_dagster.hidden.extract_hf import extract_all_hf
    from eagle3_dagster.hidden.dataset import HiddenStatesDataset
    from eagle3_dagster.layers import default_aux_layers

    aux = list(default_aux_layers(num_layers))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides (PyTorch's default, made explicit)
    torch.backends.cudnn.allow_tf32 = False

    def run(dev: str, dtype: str, tag: str = "") -> tuple[HiddenStatesDataset, float]:
        out = work / f"hidden-{tag}{dev}-{dtype}"
        start = time.perf_counter()
        extract_all_hf(
            target,
            merged,
            out,
            samples_per_shard=32,
            aux_layers=aux,
            dtype=dtype,
            batch_tokens=4096,
            target_identity="gpu-check-tiny",
            device=dev,
        )
        return HiddenStatesDataset(out), time.perf_counter() - start

    reference, _ = run("cpu", "float32", tag="reference-")
    rows = []
    # limits on the relative error of a whole sample's state and of any single token's row
    for dtype, (sample_limit, token_limit) in (("float32", (1e-4, 1e-3)), ("bfloat16", (3e-2, 5e-2))):
        got, seconds = run(device, dtype)
        worst, worst_token, worst_at, same_ids = 0.0, 0.0, "-", len(got) == len(reference)
        for i in range(min(len(got), len(reference))):
            a, r = got[i], reference[i]
            same_ids &= a["sample_id"] == r["sample_id"] and torch.equal(a["input_ids"], r["input_ids"])
            for name in ("aux_hidden", "last_hidden"):
                diff, ref = a[name].float() - r[name].float(), r[name].float()
                err = float(diff.norm() / ref.norm())
                worst_token = max(worst_token, float((diff.norm(dim=-1) / ref.norm(dim=-1)).max()))
                if err > worst:
                    worst, worst_at = err, f"{r['sample_id']}/{name}"
        ok = same_ids and worst <= sample_limit and worst_token <= token_limit
        rows.append(
            {
                "check": f"hf extraction {device} {dtype} vs cpu float32",
                "ok": ok,
                "detail": f"{len(got)} samples; relative error: worst sample {worst:.1e} ({worst_at}, limit "
                f"{sample_limit:g}), worst token {worst_token:.1e} (limit {token_limit:g}); ids "
                f"{'equal' if same_ids else 'DIFFER'}; {seconds:.1f}s",
            }
        )
    return rows, work / f"hidden-{device}-bfloat16"


# -- 3. torchrun --------------------------------------------------------------------------------------------------


def run_group(argv: list[str], timeout_s: float) -> tuple[int | None, str]:
    """(exit status or None on timeout, output); the launcher and its workers are killed together on timeout."""
    import signal

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out + f"\n(timed out after {timeout_s:.0f}s)"


def check_training(
    device: str,
    work: Path,
    target: Path,
    merged: Path,
    vocab_size: int,
    hidden_dir: Path,
    steps: int,
    timeout_s: float,
    attention: str = "gqa",
    probe_allreduce: bool = True,
) -> list[dict]:
    """torchrun of the demo drafter (with `attention`) for `steps` steps; a row per check. The export lands in
    `work/train-<attention>/export`."""
    import torch

    from eagle3_dagster.data.vocab import build_vocab_mapping
    from eagle3_dagster.train import TrainJobConfig, build_torchrun_command

    cuda = device == "cuda"
    profile = demo_profile()  # the demo drafter and its training settings, for `steps` steps
    nproc = torch.cuda.device_count() if cuda else 1
    backend = "nccl" if cuda else "gloo"
    rows: list[dict] = []
    if probe_allreduce:
        rows.append(check_allreduce(cuda, nproc, work, timeout_s))
    mapping = work / "vocab_mapping.safetensors"
    if not mapping.exists():
        build_vocab_mapping([merged], mapping, target_vocab_size=vocab_size, draft_vocab_size=vocab_size // 4)
    out = work / f"train-{attention}"
    job = TrainJobConfig(
        hidden_version_dir=str(hidden_dir),
        target_dir=str(target),
        vocab_mapping=str(mapping),
        out_dir=str(out),
        serving_context=profile.target.serving_context,
        drafter=type(profile.drafter).model_validate(
            profile.drafter.model_dump()
            | {"attention": attention, **({"num_key_value_heads": None} if attention == "mla" else {})}
        ),
        train=profile.train.model_copy(
            update={"max_steps": steps, "backend": backend, "nproc_per_node": nproc, "checkpoint_every": 25}
        ),
    )
    config = job.write(work / f"train_job-{attention}.json")
    start = time.perf_counter()
    code, said = run_group(build_torchrun_command(config, nproc), timeout_s)
    seconds = time.perf_counter() - start
    metrics_path = out / "metrics.json"
    what = f"torchrun training {attention.upper()} drafter"
    if code != 0 or not metrics_path.exists():
        tail = [line for line in said.strip().splitlines() if line.strip()][-12:]
        rows.append({"check": f"{what} {steps} steps", "ok": False, "detail": f"exit {code}: " + " | ".join(tail)})
        return rows
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["curves"]["loss"]
    import math

    finite = all(math.isfinite(x) for x in losses)
    exported = (out / "export" / "config.json").exists()
    ok = metrics["steps"] == steps and finite and losses[-1] < losses[0] and exported
    rows.append(
        {
            "check": f"{what} ({backend}{', bf16 autocast' if cuda else ''}, {nproc} rank{'s' if nproc > 1 else ''})",
            "ok": ok,
            "detail": f"{metrics['steps']} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"acc_0 {metrics['final']['acc_0']:.3f}, {metrics['tokens_per_s']:.0f} tok/s, "
            f"export {'written' if exported else 'MISSING'}, {seconds:.0f}s wall",
        }
    )
    return rows


def check_allreduce(cuda: bool, nproc: int, work: Path, timeout_s: float) -> dict:
    backend = "nccl" if cuda else "gloo"
    probe = work / "allreduce.py"
    probe.write_text(
        "import os, torch, torch.distributed as dist\n"
        f"dist.init_process_group({backend!r})\n"
        f"dev = torch.device('cuda', int(os.environ['LOCAL_RANK'])) if {cuda} else torch.device('cpu')\n"
        "x = torch.full((1 << 20,), float(dist.get_rank() + 1), device=dev, dtype=torch.bfloat16)\n"
        "dist.all_reduce(x)\n"
        "w = dist.get_world_size()\n"
        "assert float(x[0]) == w * (w + 1) / 2 and bool((x == x[0]).all()), float(x[0])\n"
        "if dist.get_rank() == 0: print(f'ALLREDUCE_OK world={w}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    code, said = run_group(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone", str(probe)],
        timeout_s,
    )
    return {
        "check": f"torchrun {backend} all-reduce (bf16)",
        "ok": code == 0 and "ALLREDUCE_OK" in said,
        "detail": next((line for line in said.splitlines() if "ALLREDUCE_OK" in line), said.strip()[-300:]),
    }


# -- 4. the MLA drafter's export, drafted on the device and served by SGLang ----------------------------------------


def check_mla_export(
    device: str,
    work: Path,
    target: Path,
    merged: Path,
    sglang_python: str | None,
    sglang_args: list[str],
    sglang_env: dict[str, str],
    num_prompts: int = 6,
    max_new_tokens: int = 32,
) -> list[dict]:
    """The MLA drafter torchrun trained (`work/train-mla/export`): `check_export` accepts it as SGLang's
    `Eagle3DeepseekV2ForCausalLM`; the simulator drafts with its MLA cache on `device` and its output is the
    target's greedy output; and, where an SGLang interpreter is given (or this one imports sglang), that release's
    own server loads it beside the target (`--speculative-algorithm EAGLE3`) and serves the same output with the
    simulator's verify steps, prompt by prompt."""
    import torch

    from eagle3_dagster.bench.proposers import Eagle3Proposer
    from eagle3_dagster.bench.specdec import SpecConfig, TargetRunner, generate_greedy, generate_speculative
    from eagle3_dagster.drafter.export import check_export
    from eagle3_dagster.drafter.imported import load_any_drafter
    from eagle3_dagster.drafter.mla_export import is_mla
    from transformers import AutoModelForCausalLM

    export = work / "train-mla" / "export"
    config = json.loads((export / "config.json").read_text())
    check = check_export(export)
    rows = [
        {
            "check": "MLA export: check_export",
            "ok": check.ok and is_mla(config),
            "detail": f"architectures {config.get('architectures')}, kv_lora_rank {config.get('kv_lora_rank')}, "
            f"releases {(config.get('eagle3_dagster_sglang') or {}).get('releases')}; "
            + ("; ".join(check.problems) if not check.ok else "ok"),
        }
    ]
    spec = SpecConfig.parse((3, 1, 4))
    prompts = []
    with open(merged) as f:
        for line in f:
            prompts.append(json.loads(line)["input_ids"][:48])
            if len(prompts) == num_prompts:
                break
    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(dev).eval()
    proposer = Eagle3Proposer(load_any_drafter(export, target).model.float().to(dev))
    greedy, simulated = [], []
    with torch.inference_mode():
        for ids in prompts:
            greedy.append(generate_greedy(TargetRunner(model), ids, max_new_tokens).output_ids)
            simulated.append(
                generate_speculative(TargetRunner(model, proposer.aux_layers), proposer, ids, spec, max_new_tokens)
            )
    same = sum(g == s.output_ids for g, s in zip(greedy, simulated))
    accepted = sum(len(s.output_ids) - s.verify_ct for s in simulated)
    # a drafter that accepts nothing makes every verify-step comparison below trivially equal
    rows.append(
        {
            "check": f"MLA drafter simulated on {device} = greedy",
            "ok": same == len(prompts) and accepted > 0,
            "detail": f"{same}/{len(prompts)} prompts equal; {accepted} drafts accepted (must be > 0); verify "
            f"steps {[s.verify_ct for s in simulated]}",
        }
    )
    try:
        rows.append(
            _served_mla(
                work,
                target,
                export,
                prompts,
                greedy,
                simulated,
                spec,
                max_new_tokens,
                sglang_python,
                sglang_args,
                sglang_env,
            )
        )
    except Exception as e:  # the rows above stand whatever the server does
        rows.append(
            {
                "check": "MLA export served by SGLang = simulated",
                "ok": False,
                "detail": f"{type(e).__name__}: {e}"[:600] + f"; log {work / 'sglang.log'}",
            }
        )
    return rows


def _served_mla(work, target, export, prompts, greedy, simulated, spec, max_new_tokens, python, args, env) -> dict:
    import dataclasses

    import httpx

    from eagle3_dagster.gpu_host import GpuHost
    from eagle3_dagster.host_config import HostConfig
    from eagle3_dagster.ports import free_port
    from eagle3_dagster.sglang.server import sglang_server
    from eagle3_dagster.stages.bench import BenchSettings, serving_spec

    what = "MLA export served by SGLang = simulated"
    python = python or sys.executable
    found = subprocess.run([python, "-c", "import sglang; print(sglang.__version__)"], capture_output=True, text=True)
    if found.returncode != 0:
        return {
            "check": what,
            "ok": None,
            "detail": f"not run: {python} cannot import sglang (carry its wheels, or pass --sglang-python)",
        }
    installed = found.stdout.strip().splitlines()[-1]
    port = free_port()  # below the ephemeral range: nothing else is handed it while the server loads
    server = serving_spec(BenchSettings.from_profile(demo_profile()), target, export, installed, spec, port=port)
    # the tiny target has no tokenizer: the check sends token ids and reads token ids
    server = dataclasses.replace(
        server,
        extra_args=(*server.extra_args, "--skip-tokenizer-init", *args),
        env={**server.env, **env},
        health_timeout_s=1200,
    )
    host = GpuHost(HostConfig(transport="local", python=python, workdir=str(work / "sglang-host")))
    log = open(work / "sglang.log", "w")
    served = []
    try:
        with sglang_server(host, server, on_log=lambda line: print(line, file=log, flush=True)) as running:
            for ids in prompts:
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
                r = httpx.post(f"{running.base_url}/generate", json=body, timeout=600)
                r.raise_for_status()
                served.append(r.json())
    finally:
        log.close()
    same_out = sum(s["output_ids"] == g for s, g in zip(served, greedy))
    verify = [s["meta_info"].get("spec_verify_ct") for s in served]
    same_steps = sum(v == sim.verify_ct for v, sim in zip(verify, simulated))
    return {
        "check": what,
        "ok": same_out == len(prompts) and same_steps == len(prompts),
        "detail": f"SGLang {installed}: output = greedy on {same_out}/{len(prompts)}, verify steps = simulator's "
        f"on {same_steps}/{len(prompts)} ({verify}); log {work / 'sglang.log'}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--mla-steps",
        type=int,
        default=300,
        help="training steps of check 4's MLA drafter (it must accept drafts for the served comparison "
        "to mean anything)",
    )
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--timeout-s", type=float, default=300, help="per torchrun launch")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="wheels for what the interpreter lacks")
    parser.add_argument(
        "--sglang-python",
        default=None,
        help="an interpreter with SGLang for check 4's server (default: this one, where it imports sglang)",
    )
    parser.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for that server (repeat; e.g. a CPU host's --device cpu)",
    )
    parser.add_argument(
        "--sglang-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more environment variable for that server (repeat)",
    )
    args = parser.parse_args()
    unpacked = bring_wheels(args.wheels)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)"
    print(
        f"gpu_check on {where}; torch {torch.__version__}; python {sys.version.split()[0]}; work {work}; "
        f"unpacked from .whl: {', '.join(unpacked) or 'nothing'}",
        flush=True,
    )
    rows: list[dict] = []
    started = time.perf_counter()

    def step(name: str, fn):
        t = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # one failing check must not hide the others
            import traceback

            traceback.print_exc()
            result = [{"check": name, "ok": False, "detail": f"{type(e).__name__}: {e}"[:300]}]
        for r in result if isinstance(result, list) else [result]:
            r.setdefault("seconds", time.perf_counter() - t)
            rows.append(r)
        print(f"... {name} done in {time.perf_counter() - t:.0f}s", flush=True)
        return result

    step("dump hook", lambda: check_dump_hook(args.device, work))
    target, merged, num_layers, vocab_size = build_target(work, args.samples)
    hidden_dir: list[Path] = []

    def extraction():
        result, path = check_extraction(args.device, work, target, merged, num_layers)
        hidden_dir.append(path)
        return result

    step("hf extraction", extraction)
    if hidden_dir:
        step(
            "torchrun",
            lambda: check_training(
                args.device, work, target, merged, vocab_size, hidden_dir[0], args.steps, args.timeout_s
            ),
        )
        trained = step(
            "torchrun MLA",
            lambda: check_training(
                args.device,
                work,
                target,
                merged,
                vocab_size,
                hidden_dir[0],
                args.mla_steps,
                args.timeout_s,
                attention="mla",
                probe_allreduce=False,
            ),
        )
        if all(r["ok"] for r in trained):
            env = dict(kv.split("=", 1) for kv in args.sglang_env)
            step(
                "MLA export",
                lambda: check_mla_export(args.device, work, target, merged, args.sglang_python, args.sglang_arg, env),
            )
    width = max(len(r["check"]) for r in rows)
    print(f"\n{'check'.ljust(width)}  result  detail")
    for r in rows:
        result = "NOT RUN" if r["ok"] is None else "PASS" if r["ok"] else "FAIL"
        print(f"{r['check'].ljust(width)}  {result:6}  {r['detail']}")
    failed = sum(r["ok"] is False for r in rows)
    not_run = sum(r["ok"] is None for r in rows)
    print(
        f"\n{len(rows) - failed - not_run}/{len(rows)} passed, {failed} failed, {not_run} not run, in "
        f"{time.perf_counter() - started:.0f}s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
