"""Hidden-state extraction on SGLang's own server (0.5.23, CPU), checked against transformers.

One patched release server for the module, started by the project's launcher
(`gpu_host.sglang_server`: the release's extraction options from releases.json, the CPU options, and
`--chunked-prefill-size 64`), serving the micro tiny target. The project's driver prefills six samples
in one batch (concurrency 6; two share a 40-token prefix, three are longer than a prefill chunk, so
SGLang splits them and the driver stitches the chunks by request id and position) and commits the
standard shard.

Tolerance: within ENVELOPE_FACTOR of HF bf16 against HF fp32, measured here (tests/real_sglang/support.py),
and each stored aux state nearest to the HF state of its own index (an off-by-one layer is far further).
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
import torch

from eagle3_dagster.contracts import SGLANG_BACKEND_CODE_VERSION
from eagle3_dagster.gpu_host import GpuHost, LogTail, ServerSpec, sglang_server
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.hidden.plan import shard_bytes
from eagle3_dagster.hidden.sharding import plan_shards
from eagle3_dagster.hidden.shards import HiddenStatesDataset, ShardFormat, load_manifest
from eagle3_dagster.sglang.driver import DriverSettings, extract_shard_sglang
from eagle3_dagster.target import target_identity
from tests.real_sglang.support import AUX, ENVELOPE_FACTOR, VERSION, free_port, hf_states, rel_err
from tests.sglang_cpu.venv import SERVER_ARGS, server_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang]  # SGLang's own release server on CPU, in a venv built from PyPI (tests/sglang_cpu)

CHUNK = 64
LENGTHS = [150, 97, 64, 40, 23, 130]
SHARED_PREFIX = 40  # samples 0 and 1 begin with the same 40 tokens


@pytest.fixture(scope="module")
def server(sglang_python, micro_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_sglang")
    host = GpuHost(HostConfig(transport="local", python=str(sglang_python), workdir=str(tmp / "host")))
    spec = ServerSpec(model_path=str(micro_target), port=free_port(), dump_dir=str(tmp / "dumps"), dump_layers=AUX,
                      sglang_version=VERSION, extra_args=(*SERVER_ARGS, "--chunked-prefill-size", str(CHUNK)),
                      env=server_env(sglang_python), health_timeout_s=1200)
    log = LogTail(tmp / "sglang.log")
    try:
        with sglang_server(host, spec, on_log=log) as running:
            yield running, Path(spec.dump_dir), tmp
    finally:
        log.close()


def _samples(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(20)
    prefix = torch.randint(3, vocab, (SHARED_PREFIX,), generator=g).tolist()
    out = []
    for k, n in enumerate(LENGTHS):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        if k < 2:
            ids[:SHARED_PREFIX] = prefix
        out.append({"id": f"B1/conv{k}/0", "dataset": "B1", "input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)})
    return out


@pytest.mark.timeout(3600)  # the first test of the session builds the venv (minutes)
def test_stored_states_equal_hf_within_the_bf16_envelope_and_the_shard_has_the_plans_bytes(server, micro_target):
    running, dump_dir, tmp = server
    config = json.loads((micro_target / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    samples = _samples(vocab)
    assert sum(n > CHUNK for n in LENGTHS) >= 3
    merged = tmp / "merged_train.jsonl"
    merged.write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in samples))
    (spec,) = plan_shards(merged, len(samples))
    fmt = ShardFormat(hidden_size=hidden, dtype="float32", aux_layers=AUX,
                      target_identity=target_identity(micro_target), code_version=SGLANG_BACKEND_CODE_VERSION)
    version_dir = tmp / "version"
    result = extract_shard_sglang(DriverSettings(running.base_url, dump_dir, concurrency=len(samples)), merged, spec,
                                  version_dir, aux_layers=list(AUX), hidden_size=hidden, dtype="float32",
                                  target_identity=fmt.target_identity)
    assert result.num_samples == len(samples) and result.num_tokens == sum(LENGTHS)
    assert result.num_bytes == shard_bytes(spec, fmt)
    assert load_manifest(version_dir)[spec.key]["bytes"] == shard_bytes(spec, fmt)
    assert not list(dump_dir.glob("*.safetensors"))  # chunk files removed once the shard committed

    ds = HiddenStatesDataset(version_dir)
    names = [f"aux {i}" for i in AUX] + ["last"]
    errs = {n: {"sglang": [], "bf16": []} for n in names}
    nearest_ok = []
    by_id = {s["id"]: s for s in samples}
    for k in range(len(ds)):
        stored = ds[k]
        ids = by_id[ds.sample_ids[k]]["input_ids"]
        assert stored["input_ids"].tolist() == ids
        fp32 = hf_states(micro_target, torch.float32, ids)
        bf16 = hf_states(micro_target, torch.bfloat16, ids)
        got = list(stored["aux_hidden"].float().split(hidden, dim=-1)) + [stored["last_hidden"].float()]
        want = [fp32[i] for i in AUX] + [fp32[-1]]
        ref16 = [bf16[i] for i in AUX] + [bf16[-1]]
        for n, g, w, b in zip(names, got, want, ref16):
            errs[n]["sglang"].append(rel_err(g, w))
            errs[n]["bf16"].append(rel_err(b, w))
        for i, g in zip(AUX, got):  # nearest to its own index among every HF state
            dist = [rel_err(g, h).median().item() for h in fp32]
            nearest_ok.append(min(range(len(dist)), key=dist.__getitem__) == i)
    rows = []
    for n in names:
        s, b = torch.cat(errs[n]["sglang"]), torch.cat(errs[n]["bf16"])
        rows.append((n, s.median().item(), s.max().item(), b.median().item(), b.max().item()))
    table = "\n".join(f"{n:>6}: SGLang vs HF fp32 median {sm:.4%} max {sx:.4%} | HF bf16 vs HF fp32 median "
                      f"{bm:.4%} max {bx:.4%}" for n, sm, sx, bm, bx in rows)
    print(f"\nSGLang {VERSION} (CPU) vs transformers, {len(ds)} samples, {sum(LENGTHS)} tokens:\n{table}")
    (tmp / "tolerance.txt").write_text(table + "\n")
    assert all(nearest_ok), nearest_ok
    for n, sm, sx, bm, bx in rows:
        assert sm <= ENVELOPE_FACTOR * bm and sx <= ENVELOPE_FACTOR * bx, table
