"""Extraction through Kimi-K2.5's own class on SGLang's server (0.5.23, CPU), checked against transformers.

The micro tiny target, wrapped in Kimi-K2.5's checkpoint layout (`eagle3_dagster.tiny.kimi_k25`: the
same text weights under `language_model.`, a tiny random MoonViT tower and projector, our minimal
remote-code processor), is served as `KimiK25ForConditionalGeneration`, the class production runs:
its forward embeds the ids itself and calls the DeepSeek-V3 language model with `input_ids=None`
and `input_embeds` (`general_mm_embed_routine`), so the dump hook must key the rows by
`forward_batch.input_ids`. The launcher adds `--trust-remote-code`, as the production profile does.
The project's driver prefills the samples (two longer than a prefill chunk, stitched).

Checked two ways: every stored state equals transformers' `output_hidden_states` of the unwrapped
text model within the fp16 envelope of tests/real_sglang/support.py, and the shard is bit for bit the
one the same release's server stores for the same samples from the unwrapped target (`DeepseekV3ForCausalLM`,
called with the ids: the session's `plain_server`, which test_real_extraction extracts from too), so the
`input_ids=None` path changes nothing the hook captures.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.tiny.kimi_k25 import wrap_as_kimi_k25
from tests.real_sglang.support import (
    CHUNK,
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
]  # (tests/sglang_cpu); the plain server is the session's

LENGTHS = [140, 90, 33, 75]
SHARED_PREFIX = 20


def _served(python, model_dir, tmp, samples, *, trust_remote_code: bool):
    """The committed shard's version folder and SGLang's log, from a server of its own.

    One request at a time: with several in flight, which chunks share a batch depends on timing, and SGLang's
    float16 forward is not bitwise the same across batch make-ups (the two classes then differ in the last bits
    under load, not in what they compute)."""
    tmp.mkdir()
    with extraction_server(python, model_dir, tmp, trust_remote_code=trust_remote_code) as (running, dump_dir, log):
        out = extract_samples(running.base_url, dump_dir, tmp, samples, model_dir, concurrency=1)
        served = log.read_text()
    assert out.result.num_samples == len(samples) and out.result.num_tokens == sum(LENGTHS)
    return out.version_dir, served


@pytest.mark.timeout(3600)  # the first test of the session builds the venv (minutes)
def test_kimi_k25_class_stores_the_text_models_states_bit_for_bit_and_within_the_fp16_envelope(
    sglang_python, plain_server, micro_target, tmp_path
):
    kimi = wrap_as_kimi_k25(micro_target, tmp_path / "kimi_k25")
    samples = extraction_samples(
        json.loads((micro_target / "config.json").read_text())["vocab_size"], LENGTHS, SHARED_PREFIX, seed=25
    )
    assert sum(n > CHUNK for n in LENGTHS) >= 2
    wrapped_dir, log = _served(sglang_python, kimi, tmp_path / "kimi", samples, trust_remote_code=True)
    assert "type=KimiK25ForConditionalGeneration" in log, log[-3000:]  # SGLang's "Load weight end" line

    table, failures = compare_with_hf(wrapped_dir, samples, micro_target)
    print(f"\nSGLang {VERSION} (CPU), KimiK25ForConditionalGeneration vs transformers' text model, {table}")
    (tmp_path / "tolerance.txt").write_text(table + "\n")
    assert not failures, f"{failures}\n{table}"

    # The same samples, one request at a time, from the session's server of the unwrapped target.
    running, dump_dir, plain_log = plain_server
    (tmp_path / "deepseek").mkdir()
    out = extract_samples(running.base_url, dump_dir, tmp_path / "deepseek", samples, micro_target, concurrency=1)
    assert out.result.num_samples == len(samples) and out.result.num_tokens == sum(LENGTHS)
    log = plain_log.read_text()
    assert "type=DeepseekV3ForCausalLM" in log, log[-3000:]
    wrapped, plain = HiddenStatesDataset(wrapped_dir), HiddenStatesDataset(out.version_dir)
    assert sorted(plain.sample_ids) == sorted(wrapped.sample_ids)
    for k, sample_id in enumerate(wrapped.sample_ids):
        got, want = wrapped[k], plain[plain.sample_ids.index(sample_id)]
        for name in ("input_ids", "aux_hidden", "last_hidden"):
            assert torch.equal(got[name], want[name]), f"{sample_id}: {name} differs from DeepseekV3ForCausalLM's"
