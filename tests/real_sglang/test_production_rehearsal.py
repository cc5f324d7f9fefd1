"""Production, rehearsed whole on this CPU: configs/production.yaml's own shape through Dagster on real parts.

The profile is configs/production.yaml with only the keys in `OVERRIDES` changed (sizes, paths, endpoints
and the GPU count; each says why), derived here from the file itself so that the two cannot drift. Every
production code path is live:

- the datasets production names, each of its kind: A1/A2 `pretokenized_jsonl` used as they are (A1 on
  the drop list; A2 with reasoning and tool calls rendered by the target's template), B1-B8 `prompts_jsonl`
  with a path, regenerated;
- `generation.backend: openai` against SGLang's own server (0.5.23, CPU) serving the tiny Kimi-K2.5-class
  target (`KimiK25ForConditionalGeneration`, its chat template, `--reasoning-parser kimi_k2`) through its
  OpenAI-compatible API, the API key from the environment, the budget booked at the profile's prices;
- `hidden.backend: sglang` on two GPU hosts reached over ssh (two real sshd on loopback), the patched
  release server on each, shards in an object store (moto's S3 server);
- `drafter_checkpoint`: torchrun on both hosts (`--nnodes 2`, c10d rendezvous, gloo), reading the store;
- `bench.mode: served`: SGLang's server with and without the exported drafter, on a leased host;
- the instance on PostgreSQL, `dagster dev` (webserver and daemon): the data and the corpus by the command
  line (`scripts/run_pipeline.py`, as the demo runs them), the shards by the project's automation sensor on
  the daemon, training and the benchmark submitted through the webserver, as the launchpad would.

It checks what a user would: every asset materialized, the shard checks green, the drafter served with the
simulator's verify steps, the money booked equal to what the server's own counters say, nothing written
outside the roots.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import yaml

from tests.e2e.conftest import REPO, dagster_dev
from tests.real_sglang.support import VERSION
from tests.sglang_cpu.venv import SERVER_ARGS, server_env
from tests.sshd_server import free_port, start_sshd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,  # SGLang's own release server on CPU (tests/sglang_cpu), two sshd
    pytest.mark.sglang,
]  # hosts, moto, PostgreSQL and `dagster dev`: the whole production graph

API_KEY_ENV = "OPENROUTER_API_KEY"  # production's generation.api_key_env, unchanged
API_KEY = "sk-rehearsal-0123456789abcdef"
BUCKET = "eagle3-rehearsal"
PRICE = {"prompt": 1.0e-6, "completion": 3.0e-6}  # production's prices, unchanged
# SGLang's CPU options for every server of the rehearsal (tests/real_sglang/test_real_eagle3.py says why each):
# the CPU engine, the torch attention backend, a small KV pool; intel_amx for speculative decoding (its draft
# backend on CPU) and float32, so that served and simulated drafts are compared on the same floats.
# A prefill chunk as the tier's extraction tests take it: without one SGLang sizes its CPU memory for whole prompts
# of the full context and leaves none for the KV cache.
CPU_SERVER_ARGS = [
    *SERVER_ARGS,
    "--prefill-attention-backend",
    "intel_amx",
    "--decode-attention-backend",
    "intel_amx",
    "--dtype",
    "float32",
    "--chunked-prefill-size",
    "64",
]
PROMPT_DATASETS = [f"B{i}" for i in range(1, 9)]
HIDDEN = "hidden_states"
PROMPTS_PER_DATASET = 3


def overrides(ctx: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """Every key of configs/production.yaml the rehearsal changes: dotted path (`datasets[NAME].field` for a
    dataset) → (value, why). Anything not listed is production's own value."""
    hosts = [
        {
            "name": f"gpu-{i}",
            "transport": "ssh",
            "ssh_target": s.target,
            "ssh_options": list(s.options),
            "python": str(ctx["host_python"]),
            "workdir": str(ctx["root"] / f"work_{i}"),
            "num_gpus": 0,
            "sglang_port": port,
        }
        for i, (s, port) in enumerate(zip(ctx["sshd"], ctx["ports"]))
    ]
    o: dict[str, tuple[Any, str]] = {
        "run_root": (str(ctx["root"] / "run"), "path: a temp folder"),
        "target.path": (str(ctx["target"]), "path: the tiny Kimi-K2.5-class target built here"),
        "target.serving_context": (512, "size: the tiny target's context"),
        "generation.base_url": (ctx["generation_url"], "endpoint: SGLang's server on loopback, not OpenRouter"),
        "generation.model": (ctx["served_model"], "endpoint: the name that server serves"),
        "generation.reasoning_style": (
            "chat_template",
            "endpoint: SGLang takes thinking as a chat-template kwarg, not `reasoning`",
        ),
        # the tiny target's answers at production's temperature run to the limit often enough that two prompts
        # of a dataset both did, at 48
        "generation.max_new_tokens": (128, "size"),
        "generation.concurrency": (4, "size"),
        "data.max_seq_len": (192, "size: the tiny target's training length"),
        "data.draft_vocab_size": (256, "size: the tiny target's vocabulary is 512"),
        "gpu_host.hosts": (
            hosts,
            "endpoints: two sshd hosts on loopback (one machine: a port each), the SGLang "
            "venv's interpreter; GPU count: none (num_gpus 0)",
        ),
        "gpu_host.lease_dir": (str(ctx["root"] / "leases"), "path"),
        "hidden.root": (f"s3://{BUCKET}/hidden_states", "path: moto's S3 server instead of local NVMe"),
        "hidden.aux_layers": ([2, 3, 4], "size: [2, L//2, L-3] of 61 layers is [2, 3, 4] of the tiny target's 6"),
        "hidden.samples_per_shard": (32, "size: two shards, one per host"),
        "hidden.tp_size": (1, "GPU count"),
        "hidden.sglang_server_args": (CPU_SERVER_ARGS, "GPU count: the CPU engine's options instead of GPUs"),
        # the one key that is neither: production's tick is every 10 minutes, which a test cannot wait for
        "hidden.backfill_cron": ("* * * * *", "time: a tick every minute"),
        "hidden.backfill_batch": (8, "size: every shard at the first tick"),
        "train.nnodes": (2, "GPU count: two hosts of one GPU each"),
        "train.nproc_per_node": (1, "GPU count"),
        "train.backend": ("gloo", "GPU count: no NCCL without GPUs"),
        "train.epochs": (2, "size"),
        "train.batch_tokens": (192, "size: data.max_seq_len"),
        "train.checkpoint_every": (20, "size"),
        "train.eval_fraction": (0.1, "size: enough held-out samples of a tiny corpus"),
        "bench.num_prompts": (3, "size"),
        "bench.max_new_tokens": (24, "size"),
        "bench.spec_configs": ([[3, 1, 4]], "size: one configuration (a server start apiece)"),
        "bench.concurrency": (
            1,
            "size: one request at a time, so that no batch of others moves a float of the "
            "served drafts compared with the simulator's",
        ),
        "bench.set_paths": (ctx["bench_sets"], "paths: local copies of the sets (no hub here)"),
    }
    for name, path in ctx["datasets"].items():
        o[f"datasets[{name}].path"] = (str(path), "path: a local file of the dataset's kind")
        o[f"datasets[{name}].max_conversations"] = (PROMPTS_PER_DATASET if name.startswith("B") else 20, "size")
    return o


def derive(production: dict, changes: dict[str, tuple[Any, str]]) -> dict:
    """`production` with each dotted path in `changes` set; a path production does not have is refused unless it
    is a field of a section production has (so that a renamed key fails here, not silently)."""
    from eagle3_dagster.config import Profile

    raw = json.loads(json.dumps(production))
    for path, (value, _why) in changes.items():
        node: Any = raw
        parts = path.split(".")
        for part in parts[:-1]:
            if m := re.fullmatch(r"(\w+)\[(\w+)\]", part):
                (node,) = [d for d in node[m.group(1)] if d["name"].startswith(m.group(2))]
            else:
                node = node[part]
        node[parts[-1]] = value
    Profile.model_validate(raw)
    return raw


def _short_prompts(n: int, tokenizer) -> list[str]:
    from eagle3_dagster.data.sharegpt import ShareGPTReader

    out = []
    for conv in ShareGPTReader(split="train"):
        text = conv.messages[0]["content"]
        if conv.messages[0]["role"] == "user" and len(tokenizer.encode(text)) <= 40:
            out.append(text)
        if len(out) == n:
            return out
    raise AssertionError("not enough short ShareGPT prompts")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _datasets(root: Path, tokenizer, production: dict) -> dict[str, Path]:
    """A file of each production dataset's kind: prompts for B1-B8, pre-tokenized turns (reasoning, tool calls
    and their results, rendered by the target's template) for A1 and A2."""
    from eagle3_dagster.data.tokenize import build_turn_sample

    n = PROMPTS_PER_DATASET
    prompts = _short_prompts(n * len(PROMPT_DATASETS) + 20, tokenizer)
    files = {}
    for ds in production["datasets"]:
        name = ds["name"][:2]
        path = root / "sources" / f"{ds['name']}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if ds["source"] == "prompts_jsonl":
            k = PROMPT_DATASETS.index(name)
            lines = [{"id": f"{name}-{j}", "prompt": prompts[n * k + j]} for j in range(n)]
        else:
            lines = []
            for j in range(20):
                question = prompts[n * len(PROMPT_DATASETS) + j]
                messages = [{"role": "user", "content": question}]
                calls = (
                    [
                        {
                            "id": "functions.get_weather:0",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ]
                    if j % 2
                    else None
                )
                ids, mask, _ = build_turn_sample(
                    tokenizer,
                    messages,
                    f"The user asks: {question[:40]}",
                    None if calls else f"Answer {j}.",
                    calls,
                    tools=TOOLS,
                )
                lines.append({"id": f"{name}-{j}", "input_ids": ids, "loss_mask": mask})
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
        files[ds["name"]] = path
    return files


def _bench_sets(root: Path, prompts: list[str], production: dict) -> dict[str, str]:
    out = {}
    for name in production["bench"]["sets"]:
        path = root / "bench_sets" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if name == "humaneval":
            records = [
                {"task_id": f"he/{i}", "prompt": f"def f{i}(x):\n    # {p[:30]}\n"} for i, p in enumerate(prompts)
            ]
        elif name == "tool_use":
            records = [
                {"id": f"tu{i}", "messages": [{"role": "user", "content": p}], "tools": TOOLS}
                for i, p in enumerate(prompts)
            ]
        else:
            records = [{"id": f"{name}{i}", "prompt": p} for i, p in enumerate(prompts)]
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
        out[name] = str(path)
    return out


def _ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


HOST_PYTHON = """#!/bin/sh
# The GPU host's interpreter: the SGLang venv's, with the tier's model-module list (tests/sglang_cpu/venv.py)
export SGLANG_DISABLED_MODEL_ARCHS={archs}
exec {python} "$@"
"""


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    ]
    assert values, f"no {name} in {base_url}/metrics"
    return sum(values)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, sglang_python, postgres) -> Iterator[dict]:
    """The whole rehearsal, once for the module's checks; the instance's PostgreSQL variables are set while its
    tests read the instance."""
    with pytest.MonkeyPatch.context() as mp:
        yield _rehearse(tmp_path_factory, sglang_python, postgres, mp)


def _rehearse(tmp_path_factory, sglang_python, postgres, mp: pytest.MonkeyPatch) -> dict:
    from moto.server import ThreadedMotoServer

    from eagle3_dagster.gpu_host import GpuHost
    from eagle3_dagster.host_config import HostConfig
    from eagle3_dagster.sglang.server import LogTail, ServerSpec, sglang_server
    from eagle3_dagster.target import load_tokenizer
    from eagle3_dagster.tiny.build import build_tiny_target
    from eagle3_dagster.tiny.kimi_k25 import wrap_as_kimi_k25
    from eagle3_dagster.config import load_profile

    root = tmp_path_factory.mktemp("rehearsal")
    database = "rehearsal"  # a database of its own on the session's server (the shared micro run has "eagle3")
    conn = postgres.connect()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {database} OWNER {postgres.env['DAGSTER_PG_USER']}")
    conn.close()
    untracked_before = _untracked()
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())

    # The target: the micro architecture at 6 layers (aux layers from 2 on read alike by every release), in
    # Kimi-K2.5's checkpoint layout, served with --trust-remote-code as production's is.
    tiny = load_profile("micro", overrides={"target": {"tiny": {"num_hidden_layers": 6}}}).target.tiny
    build_tiny_target(tiny, root / "text_target")
    target = wrap_as_kimi_k25(root / "text_target", root / "models" / "Kimi-K2.5")
    tokenizer = load_tokenizer(target, trust_remote_code=True)

    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    host, port = s3.get_host_and_port()
    store_env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    httpx.put(f"{store_env['AWS_ENDPOINT_URL']}/{BUCKET}", timeout=30).raise_for_status()
    # the store's endpoint and keys are in the GPU hosts' login environment, as a production host's credentials are
    sshd = [start_sshd(root / f"sshd_{i}", env=store_env) for i in range(2)]
    host_python = root / "host_python"
    host_python.write_text(
        HOST_PYTHON.format(archs=server_env(sglang_python)["SGLANG_DISABLED_MODEL_ARCHS"], python=sglang_python)
    )
    host_python.chmod(0o755)
    generation_log = LogTail(root / "generation_server.log")
    local = GpuHost(HostConfig(transport="local", python=str(host_python), workdir=str(root / "generation_host")))
    spec = ServerSpec(
        model_path=str(target),
        port=free_port(),
        extra_args=(
            *CPU_SERVER_ARGS,
            "--reasoning-parser",
            "kimi_k2",
            "--tool-call-parser",
            "kimi_k2",
            "--enable-metrics",
        ),
        trust_remote_code=True,
        health_timeout_s=1800,
        sglang_version=VERSION,
    )
    try:
        with sglang_server(local, spec, on_log=generation_log) as served:
            ctx = {
                "root": root,
                "target": target,
                "sshd": sshd,
                "host_python": host_python,
                "ports": _ports(2),
                "generation_url": f"{served.base_url}/v1",
                "served_model": served.served_model_name,
                "datasets": _datasets(root, tokenizer, production),
                "bench_sets": _bench_sets(root, _short_prompts(3, tokenizer), production),
            }
            changes = overrides(ctx)
            profile_path = root / "production_rehearsal.yaml"
            profile_path.write_text(yaml.safe_dump(derive(production, changes), sort_keys=False))
            home = root / "dagster_home"
            home.mkdir()
            shutil.copy(REPO / "deploy" / "postgres" / "dagster.yaml", home / "dagster.yaml")
            env = {
                **os.environ,
                **postgres.env,
                "DAGSTER_PG_DB": database,
                **store_env,
                "DAGSTER_HOME": str(home),
                "EAGLE3_PROFILE": str(profile_path),
                API_KEY_ENV: API_KEY,
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1",
            }
            for name in (
                "DAGSTER_PG_HOST",
                "DAGSTER_PG_PORT",
                "DAGSTER_PG_USER",
                "DAGSTER_PG_PASSWORD",
                "DAGSTER_PG_DB",
            ):
                mp.setenv(name, env[name])  # for the instance this process opens
            # the server's own count from here on (its health checks at start-up generate too)
            usage_before = {
                kind: _metric(served.base_url, f"sglang:{kind}_tokens_total") for kind in ("prompt", "generation")
            }
            corpus = subprocess.run(
                [sys.executable, str(REPO / "scripts" / "run_pipeline.py"), "--until", "corpus"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            (root / "pipeline.log").write_text(corpus.stdout + corpus.stderr)
            assert corpus.returncode == 0, corpus.stdout[-4000:] + corpus.stderr[-4000:]
            usage = {
                kind: _metric(served.base_url, f"sglang:{kind}_tokens_total") - usage_before[kind]
                for kind in ("prompt", "generation")
            }
        result = {
            "ctx": ctx,
            "changes": changes,
            "profile": profile_path,
            "env": env,
            "home": home,
            "corpus_log": corpus.stdout,
            "usage": usage,
            "untracked_before": untracked_before,
        }
        with dagster_dev(REPO / "workspace.yaml", home, "eagle3_dagster", env=env, startup_s=300) as dep:
            result["shards"] = _wait_for_automation(dep, env, timeout_s=1500)
            run_id = dep.submit("train_job")
            result["train_run"] = dep.wait_for_run(run_id, timeout_s=1800)
            result["train_log"] = dep.run_log(run_id)
        import s3fs

        store = s3fs.S3FileSystem(endpoint_url=store_env["AWS_ENDPOINT_URL"], key="testing", secret="testing")
        result["store_top"] = store.ls(BUCKET)
        return result
    finally:
        generation_log.close()
        for s in sshd:
            s.stop()
        s3.stop()


def _wait_for_automation(dep, env: dict, timeout_s: float) -> dict:
    """Every registered shard materialized by runs the automation sensor requested (none by the test)."""
    import time

    import dagster as dg

    hidden = dg.AssetKey(HIDDEN)
    deadline = time.monotonic() + timeout_s
    while True:
        with dg.DagsterInstance.from_config(str(dep.home)) as instance:
            keys = set(instance.get_dynamic_partitions("hidden_state_shards"))
            done = instance.get_materialized_partitions(dg.AssetKey("hidden_states"))
            runs = [r for r in instance.get_runs() if r.asset_selection and hidden in r.asset_selection]
        failed = [r for r in runs if r.status == dg.DagsterRunStatus.FAILURE]
        assert not failed, "\n\n".join(dep.run_log(r.run_id)[-6000:] for r in failed)
        if keys and done >= keys:
            return {"keys": sorted(keys), "runs": [{"run_id": r.run_id, "tags": dict(r.tags)} for r in runs]}
        if time.monotonic() > deadline:
            raise TimeoutError(f"shards {sorted(keys - done)} not materialized in {timeout_s} s\n{dep.log_tail()}")
        time.sleep(2)


def test_the_rehearsal_profile_is_production_but_for_sizes_paths_endpoints_and_the_gpu_count(rehearsal):
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
    derived = yaml.safe_load(rehearsal["profile"].read_text())

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            return {k: v for key, value in d.items() for k, v in flat(value, f"{prefix}{key}.").items()}
        if isinstance(d, list) and d and all(isinstance(x, dict) and "name" in x for x in d):
            return {k: v for x in d for k, v in flat(x, f"{prefix[:-1]}[{x['name']}].").items()}
        return {prefix[:-1]: d}

    before, after = flat(production), flat(derived)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    listed = set(rehearsal["changes"])
    covered = {
        k for k in before.keys() | after.keys() if any(k == p or k.startswith((p + ".", p + "[")) for p in listed)
    }
    assert changed and changed <= covered, sorted(changed - covered)
    assert all(
        why.split(":")[0] in {"size", "path", "paths", "endpoint", "endpoints", "GPU count", "time"}
        for _, why in rehearsal["changes"].values()
    )


def test_every_asset_materialized_through_the_instance(rehearsal):
    import dagster as dg

    run = rehearsal["train_run"]
    assert run["status"] == "SUCCESS", rehearsal["train_log"][-6000:]
    with dg.DagsterInstance.from_config(str(rehearsal["home"])) as instance:
        for asset in ("merged_train", "vocab_mapping", "extraction_plan", "drafter_checkpoint", "benchmark_report"):
            assert instance.get_latest_materialization_event(dg.AssetKey(asset)) is not None, asset
        names = [d["name"] for d in yaml.safe_load(rehearsal["profile"].read_text())["datasets"]]
        for asset in ("raw_responses", "tokenized_dataset"):
            assert instance.get_materialized_partitions(dg.AssetKey(asset)) == set(names), asset
        checks = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [dg.AssetCheckKey(dg.AssetKey("hidden_states"), n) for n in ("bytes_match_plan", "manifest_checksums")]
        )
        assert checks and all(c.status.value == "SUCCEEDED" for c in checks.values()), checks


def test_the_shards_were_extracted_on_both_hosts_by_the_automation(rehearsal):
    runs = rehearsal["shards"]["runs"]
    assert runs and all(
        "dagster/automation_condition" in r["tags"] or r["tags"].get("dagster/sensor_name") for r in runs
    ), runs
    assert {r["tags"].get("eagle3/gpu_host") for r in runs} == {"gpu-0", "gpu-1"}


def test_drafter_checkpoint_trained_on_both_hosts_from_the_store(rehearsal):
    log = rehearsal["train_log"]
    launches = re.findall(r"launching on (gpu-\d): (.*)", log)
    assert sorted(host for host, _ in launches) == ["gpu-0", "gpu-1"], log[-3000:]
    assert all("--nnodes=2" in argv and "--rdzv-backend=c10d" in argv for _, argv in launches)
    job = json.loads(next((rehearsal["ctx"]["root"] / "run" / "drafter").glob("run-*/job.json")).read_text())
    assert job["hidden_version_dir"].startswith(f"s3://{BUCKET}/hidden_states/")


def test_the_money_booked_is_what_the_servers_usage_says(rehearsal):
    import dagster as dg

    usage = rehearsal["usage"]
    billed = usage["prompt"] * PRICE["prompt"] + usage["generation"] * PRICE["completion"]
    with dg.DagsterInstance.from_config(str(rehearsal["home"])) as instance:
        records = instance.fetch_materializations(dg.AssetKey("raw_responses"), limit=100).records
    booked = {
        r.partition_key: r.asset_materialization.metadata["recorded_cost_usd"].value
        for r in records
        if "recorded_cost_usd" in r.asset_materialization.metadata
    }
    assert sorted(k[:2] for k in booked) == PROMPT_DATASETS  # one materialization each: nothing paid twice
    assert sum(booked.values()) == pytest.approx(billed, rel=1e-9), (booked, billed, usage)


def test_the_served_drafter_takes_the_simulators_verify_steps(rehearsal):
    """SGLang's verify steps with the exported drafter, set by set, equal the project's simulator's on the prompts
    the served benchmark sent (its client's file on the host), both in float32 (tests/real_sglang/test_real_eagle3.py
    says why no tolerance is needed)."""
    import dagster as dg
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_dagster.bench.proposers import Eagle3Proposer
    from eagle3_dagster.bench.specdec import SpecConfig, TargetRunner, generate_speculative
    from eagle3_dagster.drafter.imported import load_any_drafter

    ctx = rehearsal["ctx"]
    with dg.DagsterInstance.from_config(str(rehearsal["home"])) as instance:
        export = (
            instance.get_latest_materialization_event(dg.AssetKey("drafter_checkpoint"))
            .asset_materialization.metadata["export_dir"]
            .value
        )
        results = (
            instance.get_latest_materialization_event(dg.AssetKey("benchmark_report"))
            .asset_materialization.metadata["results_json"]
            .value
        )
    served = {
        r["set"]: r["verify_ct"] for r in json.loads(Path(results).read_text())["rows"] if r["method"] == "eagle3"
    }
    prompt_files = sorted((ctx["root"]).glob("work_*/bench/prompts-*.jsonl"))
    assert prompt_files, "the benchmark client's prompt file is on a host"
    prompts = [orjson.loads(line) for line in prompt_files[-1].read_bytes().splitlines()]
    text_target = ctx["root"] / "text_target"
    eos = set(json.loads((text_target / "generation_config.json").read_text())["eos_token_id"])
    model = AutoModelForCausalLM.from_pretrained(text_target, dtype=torch.float32).eval()
    proposer = Eagle3Proposer(load_any_drafter(Path(export), text_target).model.float())
    target = TargetRunner(model, proposer.aux_layers)
    (spec,) = [SpecConfig.parse(tuple(c)) for c in rehearsal["changes"]["bench.spec_configs"][0]]
    simulated: dict[str, int] = {}
    with torch.inference_mode():
        for p in prompts:
            out = generate_speculative(
                target, proposer, p["input_ids"], spec, rehearsal["changes"]["bench.max_new_tokens"][0], eos
            )
            simulated[p["set"]] = simulated.get(p["set"], 0) + out.verify_ct
    assert served == simulated


def _untracked() -> set[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return {line[3:] for line in out.splitlines() if line.startswith("??")}


def test_nothing_was_written_outside_the_roots(rehearsal):
    """No production path was touched (the derived profile left none in use), nothing new in the checkout, and
    the store holds nothing but hidden.root."""
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
    paths = [
        production["run_root"],
        production["hidden"]["root"],
        production["target"]["path"],
        *(d["path"] for d in production["datasets"]),
        *production["bench"]["set_paths"].values(),
        *(h["workdir"] for h in production["gpu_host"]["hosts"]),
    ]
    assert [p for p in paths if Path(p).exists()] == []
    assert _untracked() <= rehearsal["untracked_before"]
    assert rehearsal["store_top"] == [f"{BUCKET}/hidden_states"]
