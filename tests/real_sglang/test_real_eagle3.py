"""EAGLE-3 served by SGLang's own server (0.5.23, CPU): what is trained is what is served.

A drafter of a 6-layer tiny target (the micro profile's, with aux layers [2, 3, 4]: see `eagle3_profile`), trained here for a few seconds on the target's own greedy continuations
(the project's TTT objective, `train.loop.TTTObjective`) and written by the project's export
(`drafter.export.export_drafter`), is served by the release server with the served benchmark's launch
flags (`stages.bench.serving_spec`: `--speculative-algorithm EAGLE3`, the export, the micro profile's spec
config, the release's serving options), the tier's CPU options with SGLang's CPU attention backend
(`intel_amx`, the only one its EAGLE draft worker has on CPU) and `--dtype float32`: the simulator it is
compared with runs the target and the drafter in float32, so that SGLang's default (float16 for a float32
checkpoint) does not move argmaxes that both sides should agree on.

On the held-out prompts of the micro profile's benchmark (`bench.prompts.heldout_sharegpt`, rendered
with the target's chat template, SGLang stopping at the eos the stage gives the simulator):
- every served output equals the target's own greedy output (transformers, float32), token for token;
- per prompt, SGLang's own verify steps (`meta_info.spec_verify_ct`) and accepted drafts
  (`spec_num_correct_drafts`) against the project's simulator (`bench.specdec.generate_speculative` with
  the export loaded by `drafter.imported.load_any_drafter`, as the in-process benchmark loads it), and
  SGLang's `spec_accept_length` against the simulator's acceptance length.

Tolerance: none. Per prompt, SGLang's verify steps must equal the simulator's exactly (so the acceptance lengths
are equal too, the outputs being equal). Both sides run float32 on the same inputs, and the top-2 logit margin of
every draft the simulator makes on the 12 prompts was 0.029 or more at TRAIN_STEPS = 100 (0.005 at 300), three
orders of magnitude above float32 differences between two implementations; a real difference is not small either:
the export served one layer off (an earlier defect) moved 3 of 7 prompts by a verify step. Accepted drafts are printed, not
compared: SGLang counts the drafts it accepted past `max_new_tokens` (`spec_num_correct_drafts`) and then
truncates, while the simulator drafts no further than the tokens still wanted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
import torch

from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang.server import LogTail, sglang_server
from tests.real_sglang.support import VERSION
from tests.sshd_server import free_port
from tests.sglang_cpu.venv import SERVER_ARGS, server_env
from eagle3_dagster.stages.bench import BenchSettings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
]  # SGLang's own release server on CPU, in a venv built from PyPI (tests/sglang_cpu)

NUM_TRAIN_PROMPTS = 48
# 100: the simulator's acceptance on the held-out prompts is what 300 steps give (244 drafts accepted in 85 verify
# steps, accept length 3.95) at a third of the CPU (~45 s on one thread), and its smallest draft margin is wider.
TRAIN_STEPS = 100
NUM_PROMPTS = 12  # held-out prompts served and simulated
MAX_NEW_TOKENS = 48
# SGLang's CPU attention backend for speculative decoding is `intel_amx` (`srt/layers/attention/intel_amx_backend.py`,
# whose two kernels the shim implements in torch): `torch_native` has no EAGLE draft backend
# (`speculative/draft_utils.py`) and no TARGET_VERIFY metadata (its extend reads `extend_seq_lens`, which verify
# batches do not carry). It is named through the split flags: SGLang's post-processing
# (`arg_groups/overrides.py:_attention_backend_platform_fallbacks`) turns `--attention-backend intel_amx` into
# `torch_native` when `get_platform().has_amx` is False, which it is under the shim (`cpu_has_amx_support()` needs
# `convert_weight_packed`, which the shim leaves unregistered so that every other layer stays on native torch);
# the split `--prefill-attention-backend`/`--decode-attention-backend` win over `attention_backend` and are not
# reset. float32: see above.
EAGLE3_CPU_ARGS = (
    "--prefill-attention-backend",
    "intel_amx",
    "--decode-attention-backend",
    "intel_amx",
    "--dtype",
    "float32",
)


def _greedy_corpus(model, aux: tuple[int, ...], prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """The target's own greedy continuations with its states: what extraction would store for them."""
    from eagle3_dagster.bench.specdec import TargetRunner, generate_greedy

    runner, out = TargetRunner(model), []
    for ids in prompts:
        answer = generate_greedy(runner, ids, new_tokens).output_ids
        full = torch.tensor([ids + answer])
        with torch.inference_mode():
            states = model(input_ids=full, output_hidden_states=True).hidden_states
        out.append(
            {
                "input_ids": full[0],
                "loss_mask": torch.tensor([0] * len(ids) + [1] * len(answer)),
                "aux_hidden": torch.cat([states[i][0] for i in aux], -1),
                "last_hidden": states[-1][0],
            }
        )
    return out


def _train_and_export(target_dir: Path, profile, out: Path) -> Path:
    """A drafter trained briefly with the project's TTT objective, exported as drafter_checkpoint exports."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3_dagster.bench.prompts import BenchPrompt, PromptSet, render_prompts
    from eagle3_dagster.data.sharegpt import ShareGPTReader
    from eagle3_dagster.data.vocab import build_mapping, select_draft_vocab
    from eagle3_dagster.drafter.export import export_drafter
    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_dagster.drafter.target_head import load_target_tensors
    from eagle3_dagster.train.data import collate
    from eagle3_dagster.train.loop import TTTObjective

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    aux = tuple(profile.hidden.aux_layers)
    train = []
    for conv in ShareGPTReader(split="train", heldout_fraction=profile.data.heldout_fraction):
        user = next((m for m in conv.messages if m["role"] == "user" and m["content"].strip()), None)
        if user is not None:
            train.append(BenchPrompt(conv.id, (user,)))
        if len(train) == NUM_TRAIN_PROMPTS:
            break
    prompts = [ids for _, ids in render_prompts(tokenizer, PromptSet("train", "sharegpt train", tuple(train)), 192)]
    samples = _greedy_corpus(model, aux, prompts, MAX_NEW_TOKENS)
    counts = np.zeros(model.config.vocab_size, dtype=np.int64)
    for s in samples:
        counts += np.bincount(s["input_ids"][s["loss_mask"].bool()].numpy(), minlength=counts.size)
    d2t, t2d = build_mapping(select_draft_vocab(counts, profile.data.draft_vocab_size), counts.size)
    target = load_target_tensors(target_dir, want=("embed", "lm_head"))
    a = target.arch
    if profile.drafter.attention == "mla":  # the MLA drafter the training worker builds (test_real_eagle3_mla.py)
        cfg = DrafterConfig.from_profile(
            profile.drafter,
            a,
            draft_vocab_size=len(d2t),
            aux_layers=aux,
            serving_context=profile.target.serving_context,
        )
    else:
        cfg = DrafterConfig.for_target(
            target_hidden_size=a.hidden_size,
            target_intermediate_size=a.intermediate_size,
            vocab_size=a.vocab_size,
            draft_vocab_size=len(d2t),
            aux_layers=aux,
            rms_norm_eps=a.rms_norm_eps,
            rope_theta=a.rope_theta,
            max_position_embeddings=profile.target.serving_context,
        )
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, target.embed.float(), d2t, t2d)
    objective = TTTObjective(drafter, target.lm_head.float(), profile.train.ttt_steps)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=profile.train.lr)

    class _Samples:
        def __getitem__(self, i):
            return samples[i]

    batch = collate(_Samples(), list(range(len(samples))))
    for _ in range(TRAIN_STEPS):
        loss, _stats = objective(batch.input_ids_BT, batch.loss_mask_BT, batch.aux_hidden_BT3H, batch.last_hidden_BTH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return export_drafter(drafter.eval(), out, profile.target.serving_context, torch.float32, sglang_versions=[VERSION])


@pytest.fixture(scope="module")
def eagle3_profile():
    """The micro profile on a 6-layer tiny target with aux layers [2, 3, 4], served by VERSION.

    The micro target's 4 layers leave only canonical [1, 2, 3], which no draft config makes a release from 0.5.13
    on capture for DeepSeek (`set_eagle3_layers_to_capture` adds one only when the first id is 1:
    `releases.draft_aux_ids`): the micro export's ids [0, 1, 2] are right on 0.5.10-0.5.12 only, and 0.5.23 fed
    them as layers [0, 1, 2]. Served that way, SGLang's verify steps differed from the simulator's on 3 of 7
    prompts, and the simulator fed layers [0, 1, 2] matched them on all 7. Aux layers from 2 on are read alike by
    every release (`[2, L//2, L-3]` is the default); 6 layers is the fewest with three of them below the last.
    """
    from eagle3_dagster.config import load_profile

    return load_profile(
        "micro",
        overrides={
            "target": {"tiny": {"num_hidden_layers": 6}},
            "hidden": {"aux_layers": [2, 3, 4]},
            "gpu_host": {"sglang_version": VERSION},
        },
    )


@pytest.fixture(scope="module")
def eagle3_target(tmp_path_factory, eagle3_profile) -> Path:
    from eagle3_dagster.tiny.build import build_tiny_target

    out = tmp_path_factory.mktemp("eagle3_target") / "target"
    build_tiny_target(eagle3_profile.target.tiny, out)
    return out


@pytest.mark.timeout(3600)
def test_served_eagle3_output_is_the_targets_greedy_output_and_its_acceptance_is_the_simulators(
    sglang_python, eagle3_target, eagle3_profile, tmp_path
):
    export = _train_and_export(eagle3_target, eagle3_profile, tmp_path / "export")
    rows = served_against_simulated(sglang_python, eagle3_target, eagle3_profile, export, tmp_path)
    table = "\n".join(json.dumps(r) for r in rows)
    assert [r["sglang_verify_ct"] for r in rows] == [r["sim_verify_ct"] for r in rows], table


def served_against_simulated(
    sglang_python,
    target_dir: Path,
    profile,
    export: Path,
    tmp_path: Path,
    *,
    served_target: Path | None = None,
    trust_remote_code: bool = False,
    env: dict[str, str] | None = None,
    on_log=None,
) -> list[dict]:
    """The export served by VERSION's server (the served benchmark's launch with the tier's CPU options) on the
    held-out prompts, one request at a time, against the simulator on the same prompts: asserts that every served
    output is the target's greedy output and that the drafter does accept; returns per prompt SGLang's and the
    simulator's verify steps, accepted drafts and acceptance lengths (printed, and written to acceptance.jsonl).
    `served_target`: the folder the server loads (default `target_dir`, which transformers and the simulator run);
    `env`: the server's environment (default `server_env`); `on_log(text)`: SGLang's log, once it has stopped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3_dagster.bench.prompts import heldout_sharegpt, render_prompts
    from eagle3_dagster.bench.proposers import Eagle3Proposer
    from eagle3_dagster.bench.served import prompt_token_limit
    from eagle3_dagster.bench.specdec import SpecConfig, TargetRunner, generate_greedy, generate_speculative
    from eagle3_dagster.drafter.imported import load_any_drafter
    from eagle3_dagster.stages.bench import serving_spec

    assert VERSION in json.loads((export / "config.json").read_text())["eagle3_dagster_sglang"]["releases"]
    (spec_cfg,) = [SpecConfig.parse(tuple(c)) for c in profile.bench.spec_configs]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    limit = prompt_token_limit(profile.target.serving_context, MAX_NEW_TOKENS, profile.bench.max_prompt_tokens)
    prompts = render_prompts(tokenizer, heldout_sharegpt(NUM_PROMPTS, profile.data.heldout_fraction), limit)
    eos = {i for i in [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id] if i is not None}

    # the project's simulator, as the in-process benchmark runs it
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_any_drafter(export, target_dir).model.float()
    proposer = Eagle3Proposer(drafter)
    target = TargetRunner(model, proposer.aux_layers)
    plain = TargetRunner(model)
    simulated, greedy = {}, {}
    with torch.inference_mode():
        for pid, ids in prompts:
            greedy[pid] = generate_greedy(plain, ids, MAX_NEW_TOKENS, eos).output_ids
            simulated[pid] = generate_speculative(target, proposer, ids, spec_cfg, MAX_NEW_TOKENS, eos)

    served_spec = serving_spec(
        BenchSettings.from_profile(profile), served_target or target_dir, export, VERSION, spec_cfg
    )
    served_spec = dataclasses.replace(
        served_spec,
        port=free_port(),
        health_timeout_s=1800,
        extra_args=(*served_spec.extra_args, *SERVER_ARGS, *EAGLE3_CPU_ARGS),
        env={**served_spec.env, **(env or server_env(sglang_python))},
        trust_remote_code=served_spec.trust_remote_code or trust_remote_code,
    )
    host = GpuHost(HostConfig(transport="local", python=str(sglang_python), workdir=str(tmp_path / "host")))
    log = LogTail(tmp_path / "sglang.log")
    served = {}
    try:
        with sglang_server(host, served_spec, on_log=log) as running:
            for pid, ids in prompts:  # one at a time: no batch of others moves a float
                body = {
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": MAX_NEW_TOKENS,
                        "temperature": 0.0,
                        "stop_token_ids": sorted(eos),
                    },
                }
                r = httpx.post(f"{running.base_url}/generate", json=body, timeout=600)
                assert r.status_code == 200, r.text
                served[pid] = r.json()
    finally:
        log.close()
    if on_log is not None:
        on_log((tmp_path / "sglang.log").read_text())

    rows = []
    for pid, _ids in prompts:
        out, meta, sim = served[pid]["output_ids"], served[pid]["meta_info"], simulated[pid]
        assert out == greedy[pid] == sim.output_ids, (pid, out, greedy[pid], sim.output_ids)
        rows.append(
            {
                "prompt": pid,
                "tokens": len(out),
                "sglang_verify_ct": meta["spec_verify_ct"],
                "sim_verify_ct": sim.verify_ct,
                "sglang_correct_drafts": meta["spec_num_correct_drafts"],
                "sim_accepted_drafts": sum(sim.accepted_by_position),
                "sglang_accept_length": meta["spec_accept_length"],
                "sim_accept_length_with_prefill_token": len(sim.output_ids) / sim.verify_ct,
            }
        )
    table = "\n".join(json.dumps(r) for r in rows)
    print(f"\nSGLang {VERSION} (CPU, float32) EAGLE-3 {spec_cfg.label} vs the simulator, {len(rows)} prompts:\n{table}")
    (tmp_path / "acceptance.jsonl").write_text(table + "\n")
    sglang_ct = sum(r["sglang_verify_ct"] for r in rows)
    sim_ct = sum(r["sim_verify_ct"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    print(
        f"served accept length {tokens / sglang_ct:.4f}, simulated {tokens / sim_ct:.4f} "
        f"(completion tokens / verify steps over all prompts)"
    )
    assert sim_ct > len(rows) and sum(r["sim_accepted_drafts"] for r in rows) > 0  # the drafter does accept
    return rows
