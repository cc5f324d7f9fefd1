"""Hidden-state extraction on SGLang's own server (0.5.23 and 0.5.12, CPU), checked against transformers.

One patched release server per release (0.5.23, collector-style dump patch, the session's `plain_server` that
test_real_kimi_k25 extracts from too; 0.5.12, the newest release of the other aux-id rule, loop-style dump
patch), started by the project's launcher
(`sglang.server.sglang_server`: the release's extraction options from releases.json, the CPU options, and
`--chunked-prefill-size 64`), serving the micro tiny target. The project's driver prefills six samples
in one batch (concurrency 6; two share a 40-token prefix, three are longer than a prefill chunk, so
SGLang splits them and the driver stitches the chunks by request id and position) and commits the
standard shard.

Tolerance: within ENVELOPE_FACTOR of HF fp16 (SGLang's dtype) against HF fp32, measured here
(tests/real_sglang/support.py), and each stored aux state nearest to the HF state of its own index (an
off-by-one layer is far further). The test prints the per-tensor table (`pytest -rP` or `-s`).
"""

from __future__ import annotations

import json

import pytest

from eagle3_dagster.hidden.estimate import shard_bytes
from eagle3_dagster.hidden.shards import load_manifest
from tests.real_sglang.support import (
    CHUNK,
    OLD_VERSION,
    PLAIN_SERVER_GROUP,
    VERSION,
    compare_with_hf,
    extract_samples,
    extraction_samples,
    extraction_server,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,  # SGLang's own release server on CPU, in a venv built from PyPI
    pytest.mark.xdist_group(PLAIN_SERVER_GROUP),
]  # (tests/sglang_cpu); VERSION's server is the session's

LENGTHS = [150, 97, 64, 40, 23, 130]
SHARED_PREFIX = 40  # samples 0 and 1 begin with the same 40 tokens


@pytest.fixture(scope="module", params=[VERSION, OLD_VERSION])
def server(request, sglang_pythons, micro_target, tmp_path_factory):
    version = request.param
    tmp = tmp_path_factory.mktemp(f"real_sglang_{version}")
    if version == VERSION:  # the session's, which test_real_kimi_k25 extracts from too
        running, dump_dir, _log = request.getfixturevalue("plain_server")
        yield running, dump_dir, tmp, version
        return
    with extraction_server(sglang_pythons(version), micro_target, tmp, version=version) as (running, dump_dir, _log):
        yield running, dump_dir, tmp, version


@pytest.mark.timeout(3600)  # the first test of the session builds the venv (minutes)
def test_stored_states_equal_hf_within_the_fp16_envelope_and_the_shard_has_the_plans_bytes(server, micro_target):
    running, dump_dir, tmp, version = server
    samples = extraction_samples(
        json.loads((micro_target / "config.json").read_text())["vocab_size"], LENGTHS, SHARED_PREFIX
    )
    assert sum(n > CHUNK for n in LENGTHS) >= 3
    out = extract_samples(running.base_url, dump_dir, tmp, samples, micro_target)
    assert out.result.num_samples == len(samples) and out.result.num_tokens == sum(LENGTHS)
    assert out.result.num_bytes == shard_bytes(out.spec, out.fmt)
    assert load_manifest(out.version_dir)[out.spec.key]["bytes"] == shard_bytes(out.spec, out.fmt)
    assert not list(dump_dir.glob("*.safetensors"))  # chunk files removed once the shard committed

    table, failures = compare_with_hf(out.version_dir, samples, micro_target)
    print(f"\nSGLang {version} (CPU) vs transformers, {table}")
    (tmp / "tolerance.md").write_text(table + "\n")
    assert not failures, f"{failures}\n{table}"
