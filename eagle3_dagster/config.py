"""The one typed configuration tree, loaded from a profile YAML in `configs/`.

Owns: the schema of every profile, its validation (unknown keys and bad values
are errors that name the file and the `section.field`), and the choice of the
profile from `EAGLE3_PROFILE`. It does not read the environment at import time:
`load_profile()` is called by whoever needs the config.
"""

from __future__ import annotations

import re
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROFILE_ENV_VAR = "EAGLE3_PROFILE"
DEFAULT_PROFILE = "demo"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = PROJECT_ROOT / "configs"


# Cron syntax as Dagster reads it (five fields, names, ranges, steps, `L` for the last day of the month,
# @-aliases). Checked here because the engine may not import Dagster and croniter is not a dependency; a
# test compares this with Dagster's own `is_valid_cron_string`.
_CRON_ALIASES = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
_CRON_FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day of month", 1, 31, ()),
                ("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")),
                ("day of week", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")))


def cron_problem(cron: str) -> str | None:
    """What is wrong with a cron string, or None when Dagster would accept it."""
    if cron.strip().lower() in _CRON_ALIASES:
        return None
    parts = cron.split()
    if len(parts) != 5:
        return f"{len(parts)} fields, a cron schedule has 5"
    for text, (name, lo, hi, names) in zip(parts, _CRON_FIELDS):
        for item in text.lower().split(","):
            if name == "day of month" and item == "l":
                continue
            base, _, step = item.partition("/")
            if step and not (step.isdigit() and int(step) >= 1):
                return f"{name}: bad step {step!r}"
            bounds = base.split("-") if base != "*" else []
            if len(bounds) > 2:
                return f"{name}: bad range {base!r}"
            for b in bounds:
                value = names.index(b) + (1 if name == "month" else 0) if b in names else \
                    (int(b) if b.isdigit() else None)
                if value is None or not lo <= value <= hi:
                    return f"{name}: {b!r} is not in {lo}-{hi}"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyTargetConfig(_Strict):
    """The demo's target: a DeepSeek-V3 model small enough to pre-train on a CPU."""

    seed: int = Field(0, ge=0, description="seed of the tokenizer training, the weights and the pre-training")
    vocab_size: int = Field(4096, ge=300, description="BPE vocabulary incl. special tokens")
    hidden_size: int = Field(128, ge=8, description="model width H")
    intermediate_size: int = Field(256, ge=1, description="MLP width of the dense layers")
    moe_intermediate_size: int = Field(64, ge=1, description="MLP width of each expert")
    num_hidden_layers: int = Field(4, ge=2, description="decoder layers L")
    num_attention_heads: int = Field(4, ge=1, description="attention heads (MLA)")
    q_lora_rank: int = Field(64, ge=1, description="MLA query low-rank dimension")
    kv_lora_rank: int = Field(32, ge=1, description="MLA key/value low-rank dimension")
    qk_rope_head_dim: int = Field(16, ge=2, description="MLA rotary part of each query/key head")
    qk_nope_head_dim: int = Field(16, ge=1, description="MLA non-rotary part of each query/key head")
    v_head_dim: int = Field(32, ge=1, description="MLA value head dimension")
    n_routed_experts: int = Field(8, ge=1, description="routed experts per MoE layer")
    num_experts_per_tok: int = Field(2, ge=1, description="experts each token is routed to")
    n_shared_experts: int = Field(1, ge=0, description="always-active experts per MoE layer")
    first_k_dense_replace: int = Field(1, ge=0, description="leading layers with a dense MLP instead of MoE")
    max_position_embeddings: int = Field(2048, ge=16, description="longest context the tiny target supports")
    tokenizer_train_conversations: int = Field(3000, ge=1, description="ShareGPT conversations the BPE is trained on")
    pretrain_tokens: int = Field(400_000, ge=1, description="token budget of the pre-training run")
    pretrain_seq_len: int = Field(256, ge=8, description="tokens per pre-training sequence")
    pretrain_batch_size: int = Field(8, ge=1, description="sequences per pre-training step")
    pretrain_lr: float = Field(3e-3, gt=0, le=1, description="peak learning rate of the pre-training")
    pretrain_answer_words: int | None = Field(
        None, ge=1, description="clip each assistant answer to this many words in pre-training, so the "
        "target learns to close its turns within the demo's generation budget"
    )


class TargetConfig(_Strict):
    kind: Literal["tiny", "external"] = Field(
        description="tiny: build the demo target locally; external: an existing model directory (GPU host)"
    )
    path: str | None = Field(None, description="model directory for kind=external (on the GPU host)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype the target is loaded in")
    trust_remote_code: bool = Field(
        False, description="let transformers run Python code shipped with the target's checkpoint (Kimi-K2.5 "
        "needs it for its tokenizer); off unless the profile turns it on"
    )
    serving_context: int = Field(
        2048, ge=16, description="longest context the drafter is served at; sets the export's max_position_embeddings"
    )
    tiny: TinyTargetConfig = Field(TinyTargetConfig(), description="the demo target's shape (kind=tiny)")

    @model_validator(mode="after")
    def _path_for_external(self) -> "TargetConfig":
        if self.kind == "external" and not self.path:
            raise ValueError("target.path is required when target.kind is 'external'")
        return self


# A dataset name is a Dagster partition key and a path component of every file of its partitions: one safe
# alphabet, so no name can climb out of run_root (`../x`) or land on another dataset's files.
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class DatasetConfig(_Strict):
    name: str = Field(description="partition key and file-name part, e.g. A1_deepswekimi or sharegpt: letters, "
                      "digits, '_' and '-', starting with a letter or digit, at most 64 characters")
    source: Literal["sharegpt", "prompts_jsonl", "conversations_jsonl", "pretokenized_jsonl"] = Field(
        description="sharegpt: the bundled ShareGPT file; prompts_jsonl/conversations_jsonl: chat records; "
        "pretokenized_jsonl: records with input_ids + loss_mask"
    )
    path: str | None = Field(None, description="local file or hub dataset for the *_jsonl sources")
    regenerate: bool = Field(True, description="replace assistant turns with the target's own answers")
    max_conversations: int | None = Field(None, ge=1, le=10**9, description="use at most this many conversations")
    max_turns: int = Field(8, ge=1, le=10_000, description="assistant turns regenerated per conversation at most")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not DATASET_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a dataset name: use letters, digits, '_' and '-' (starting with a "
                             "letter or digit, at most 64 characters); the name is a partition key and part of "
                             "file names under run_root")
        return value

    @model_validator(mode="after")
    def _path_for_files(self) -> "DatasetConfig":
        if self.source != "sharegpt" and not self.path:
            raise ValueError(f"datasets[{self.name}].path is required for source '{self.source}'")
        return self


class GenerationConfig(_Strict):
    backend: Literal["local", "openai"] = Field(
        description="local: the target in-process with transformers; openai: an OpenAI-compatible server"
    )
    base_url: str | None = Field(None, description="e.g. https://openrouter.ai/api/v1 or http://gpu-host:30000/v1")
    model: str | None = Field(None, description="model name the server knows, e.g. moonshotai/kimi-k2.5")
    api_key_env: str = Field("OPENROUTER_API_KEY", description="name of the environment variable holding the key")
    max_new_tokens: int = Field(256, ge=1, le=1_000_000, description="completion tokens per request at most")
    temperature: float = Field(0.0, ge=0, le=2, description="sampling temperature; 0 is greedy")
    concurrency: int = Field(8, ge=1, le=4096, description="requests in flight")
    max_retries: int = Field(6, ge=0, le=100, description="retries of a request after a retryable failure")
    timeout_s: float = Field(120.0, gt=0, le=86400, description="seconds one request may take")
    budget_usd: float | None = Field(
        None, gt=0, le=1_000_000, description="spend cap of a partition: a request is sent only when its worst-case cost "
        "(see price_usd_per_completion_token) still fits, so the cap holds at any concurrency"
    )
    price_usd_per_completion_token: float | None = Field(
        None, ge=0, le=1, description="the model's price of one completion token (USD), at least what the "
        "provider charges: each request reserves max_new_tokens x this before it is sent; needed with budget_usd"
    )
    price_usd_per_prompt_token: float = Field(
        0.0, ge=0, le=1, description="the model's price of one prompt token (USD); the reservation bounds a "
        "prompt's tokens by its UTF-8 bytes"
    )
    max_failure_fraction: float = Field(
        0.05, ge=0, le=1, description="raw_responses fails when more of a run's requests than this fail for good"
    )
    reasoning: bool = Field(True, description="ask for and keep reasoning_content")
    reasoning_style: Literal["openrouter", "chat_template"] = Field(
        "openrouter", description="openrouter: `reasoning` request field; chat_template: SGLang/vLLM thinking kwarg"
    )
    resend_interrupted: bool = Field(
        False, description="re-send requests whose answer was lost after they may have reached the provider: in "
        "flight when a run died, or timed out (they may be paid twice)"
    )
    extra_body: dict = Field(default_factory=dict, description="merged into each request, e.g. provider pinning")

    @model_validator(mode="after")
    def _url_for_openai(self) -> "GenerationConfig":
        if self.backend == "openai" and not (self.base_url and self.model):
            raise ValueError("generation.base_url and generation.model are required for backend 'openai'")
        if self.backend == "openai" and self.budget_usd is not None and self.price_usd_per_completion_token is None:
            raise ValueError("generation.price_usd_per_completion_token is required when generation.budget_usd is "
                             "set: each request reserves max_new_tokens x this price before it is sent")
        return self


class DataConfig(_Strict):
    max_seq_len: int = Field(8192, ge=16, le=2**20, description="tokens per training sample at most; longer ones are cut")
    shuffle_seed: int = Field(42, ge=0, le=2**32 - 1, description="seed of merged_train's shuffle")
    drop_datasets: list[str] = Field(default_factory=list, description="datasets left out of merged_train")
    bad_fraction_threshold: float = Field(0.05, ge=0, le=1, description="tokenized_dataset fails above this")
    heldout_fraction: float = Field(0.05, ge=0, lt=1, description="conversations kept out of training")
    draft_vocab_size: int = Field(32000, ge=1, le=2**24, description="tokens in the drafter's vocabulary")


class HostConfig(_Strict):
    """One GPU host: where its commands run and with which interpreter."""

    transport: Literal["local", "ssh"] = Field("local", description="run GPU commands here or over ssh")
    ssh_target: str | None = Field(None, description="user@host for transport=ssh")
    ssh_options: list[str] = Field(default_factory=list, description="extra ssh arguments, e.g. -p 2222")
    python: str = Field("python", description="the interpreter on the host (SGLang's environment)")
    workdir: str = Field(".eagle3/gpu_host", description="working folder on the host")
    num_gpus: int = Field(0, ge=0, le=1024, description="GPUs the preflight expects on the host")
    name: str | None = Field(None, description="the host's name in leases, run tags and logs; default: 'local' or "
                             "the ssh target (required when two hosts would get the same name)")

    @model_validator(mode="after")
    def _target_for_ssh(self) -> "HostConfig":
        if self.transport == "ssh" and not self.ssh_target:
            raise ValueError("ssh_target is required for transport 'ssh'")
        return self

    @property
    def label(self) -> str:
        return self.name or (self.ssh_target if self.transport == "ssh" else "local")


# The flat fields of `gpu_host` describe its one host when `gpu_host.hosts` is not given.
_HOST_FIELDS = tuple(HostConfig.model_fields)


class GpuHostConfig(HostConfig):
    """The GPU hosts: the one the inherited fields describe, or the list in `hosts`."""

    hosts: list[HostConfig] | None = Field(
        None, min_length=1, description="several GPU hosts (each with the fields above); each hidden_states run "
        "leases one, and the gpu_host pool gets one slot per host. Unset: the one host the fields above describe")
    lease_dir: str | None = Field(
        None, description="where the per-host lease files are locked (flock); must be one folder seen by every "
        "run worker of the instance. Unset: gpu_host_leases under the Dagster instance's storage")
    lease_wait_s: float = Field(
        600.0, ge=0, description="how long a run waits for a host leased by another run before it fails")
    sglang_version: str | None = Field(
        None, description="the SGLang release on the host (patches/sglang/README.md); the drafter export's aux "
        "ids are written for it; unset: ids right on every supported release that can express the aux layers")

    @model_validator(mode="after")
    def _hosts(self) -> "GpuHostConfig":
        if self.hosts is not None:
            flat = sorted(set(_HOST_FIELDS) & self.model_fields_set)
            if flat:
                raise ValueError(f"gpu_host.hosts is given, so gpu_host.{flat[0]} belongs in each host "
                                 f"(set {', '.join(flat)} under gpu_host.hosts[i])")
            labels = [h.label for h in self.hosts]
            twice = sorted({n for n in labels if labels.count(n) > 1})
            if twice:
                raise ValueError(f"gpu_host.hosts: names must be unique, {twice} name several hosts; give each a "
                                 "`name`")
        if self.sglang_version is not None:
            from eagle3_dagster.sglang.releases import UnsupportedRelease, release

            try:
                release(self.sglang_version)
            except UnsupportedRelease as e:
                raise ValueError(f"gpu_host.sglang_version: {e}") from None
        return self

    @property
    def all_hosts(self) -> list[HostConfig]:
        """The hosts GPU work may lease: `hosts`, or the one the flat fields describe."""
        if self.hosts is not None:
            return list(self.hosts)
        return [HostConfig(**{f: getattr(self, f) for f in _HOST_FIELDS})]


class HiddenConfig(_Strict):
    backend: Literal["hf", "sglang"] = Field("hf", description="hf: transformers (CPU or GPU); sglang: patched server")
    aux_layers: list[int] | None = Field(
        None, description="canonical numbering (HF output_hidden_states index); default [2, L//2, L-3]"
    )
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3fn"] = Field(
        "float32", description="dtype of the stored states; float8_e4m3fn stores fp8 with one scale per token row "
        "of each state, about half the bytes of bfloat16")
    root: str = Field(description="hidden-states root, one folder per version below it: a local path or an "
                      "fsspec URL (s3://bucket/prefix, gs://…; credentials and endpoint from the environment)")
    staging_dir: str | None = Field(
        None, description="local folder where shards are written and checked before upload when hidden.root is a "
        "URL (holds only the shards in flight); default <run_root>/hidden_staging")
    samples_per_shard: int = Field(256, ge=1, description="samples per shard (one partition each)")
    batch_tokens: int = Field(4096, ge=16, description="hf backend: tokens per length-bucketed batch")
    throughput_tokens_per_s: float = Field(2000.0, gt=0, description="for the plan's time estimate")
    tp_size: int = Field(1, ge=1, le=1024, description="SGLang tensor-parallel size")
    sglang_port: int = Field(30000, ge=1, le=65535, description="port of the SGLang server on the GPU host")
    sglang_concurrency: int = Field(8, ge=1, description="prefill requests in flight during extraction")
    sglang_server_args: list[str] = Field(
        default_factory=list, description="extra options for the extraction server after the release's own "
        "(e.g. --mem-fraction-static 0.85; a CPU host: --device cpu --attention-backend torch_native); options "
        "that would store other states or skip rows (radix/hierarchical cache, mixed chunks, ...) are refused")
    backfill_batch: int = Field(4, ge=1, description="shard partitions the hidden_states automation requests per tick")
    backfill_cron: str = Field("*/10 * * * *", description="when the hidden_states automation looks for missing or failed shards")
    max_runtime_s: int = Field(6 * 3600, ge=60, description="a shard run longer than this is cancelled")

    @field_validator("sglang_server_args")
    @classmethod
    def _extraction_options(cls, value: list[str]) -> list[str]:
        from eagle3_dagster.gpu_host import refused_extraction_option

        if (why := refused_extraction_option(value)) is not None:
            raise ValueError(why)
        return value

    @field_validator("staging_dir")
    @classmethod
    def _local_staging(cls, value: str | None) -> str | None:
        from eagle3_dagster.storage import is_remote

        if value is not None and is_remote(value):
            raise ValueError(f"must be a local folder (shards are written there before upload), got {value!r}")
        return value

    @field_validator("root")
    @classmethod
    def _root_location(cls, value: str) -> str:
        from eagle3_dagster.storage import location

        location(value)  # a URL carrying credentials is refused
        return value

    @field_validator("backfill_cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        problem = cron_problem(value)
        if problem:
            raise ValueError(f"not a cron schedule Dagster accepts ({problem}): {value!r}")
        return value


class DrafterOverrides(_Strict):
    hidden_size: int | None = Field(None, ge=8, description="default: the target's hidden size")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width; default: the target's")
    num_attention_heads: int | None = Field(None, ge=1, description="attention heads; default: the target's")
    num_key_value_heads: int | None = Field(None, ge=1, description="key/value heads; default: attention heads")
    fc_norm: bool = Field(False, description="EAGLE 3.1: an RMSNorm on each captured target state before fc (served "
                          "by SGLang >= 0.5.12 and vLLM, which read config.json `fc_norm`; refused for older releases)")
    norm_output: bool = Field(False, description="EAGLE 3.1: the next draft step gets the normed output, not the "
                              "pre-norm sum (config.json `norm_output`; SGLang >= 0.5.12 and vLLM)")


class TrainConfig(_Strict):
    ttt_steps: int = Field(7, ge=1, le=64, description="training-time-test unroll steps k")
    epochs: int = Field(1, ge=1, description="passes over the hidden states")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    lr: float = Field(1e-4, gt=0, le=1, description="peak learning rate")
    warmup_ratio: float = Field(0.02, ge=0, lt=1, description="share of the steps spent warming up")
    batch_tokens: int = Field(4096, ge=16, description="padded tokens per micro-batch and rank")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    grad_clip: float = Field(0.5, gt=0, description="gradient norm clip")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2)")
    loss: Literal["kl", "lk_lambda"] = Field(
        "kl", description="kl: forward KL to the target (EAGLE-3); lk_lambda: SpecForge's LK lambda objective, "
        "per TTT step λ·KL + (1 - λ)(1 - acceptance), λ = lk_kl_scale · exp(-lk_kl_decay · acceptance), "
        "acceptance = E[min(p_target, q_draft)] (arXiv 2602.23881)")
    lk_kl_scale: float = Field(1.0, ge=0, le=1, description="lk_lambda: the KL weight at zero acceptance")
    lk_kl_decay: float = Field(1.0, ge=0, le=100, description="lk_lambda: how fast the KL weight falls as acceptance rises")
    eval_fraction: float = Field(
        0.02, ge=0, lt=0.5, description="share of the hidden-state samples (chosen by a hash of the sample id, "
        "the same for every recipe) kept out of training; the drafter's reported acc_j and simulated acceptance "
        "are measured on them. 0: measured on training batches instead (flattering)")
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between checkpoints")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the drafter's init and the sampler")
    nproc_per_node: int = Field(1, ge=1, le=1024, description="torchrun workers per node")
    nnodes: int = Field(1, ge=1, le=1024, description="torchrun nodes")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous every node joins (needed when nnodes > 1); "
        "unset: a standalone single-node rendezvous")
    rdzv_id: str = Field("eagle3-drafter", min_length=1, description="rendezvous id shared by the nodes of one run")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="torch.distributed backend")
    export_location: str | None = Field(
        None, description="where the checked drafter export is also published, one folder per training run: a "
        "local path or an fsspec URL (s3://bucket/prefix; credentials from the environment); unset: the run "
        "folder only")

    @field_validator("export_location")
    @classmethod
    def _export_location(cls, value: str | None) -> str | None:
        from eagle3_dagster.storage import location

        if value is not None:
            location(value)  # a URL carrying credentials is refused
        return value

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _rendezvous(self) -> "TrainConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("train.rdzv_endpoint: required when train.nnodes > 1 (host:port of node 0)")
        if self.rdzv_endpoint and not re.fullmatch(r"[^\s:]+:\d{1,5}", self.rdzv_endpoint):
            raise ValueError(f"train.rdzv_endpoint: expected host:port, got {self.rdzv_endpoint!r}")
        return self


class BenchConfig(_Strict):
    spec_configs: list[tuple[int, int, int]] = Field(
        default_factory=lambda: [(3, 1, 4), (7, 1, 8)], description="(num_steps, topk, num_draft_tokens)"
    )
    num_prompts: int = Field(20, ge=1, description="prompts per set")
    max_new_tokens: int = Field(64, ge=1, description="tokens generated per prompt")
    sets: list[str] = Field(default_factory=lambda: ["heldout_sharegpt"], description="prompt sets to measure")
    set_paths: dict[str, str] = Field(
        default_factory=dict, description="local jsonl/parquet per prompt set (tool_use has no hub copy)"
    )
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompts longer than this are left out")
    concurrency: int = Field(8, ge=1, description="served benchmark: requests in flight")
    ngram_max: int = Field(3, ge=1, description="n-gram baseline: longest n-gram looked up in the context")
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0], description="in-process benchmark: temperatures to measure at (0 = greedy); each T > 0 uses "
        "speculative sampling with SGLang's lossless rule. Default: 0 and generation.temperature when above 0",
    )

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, value: list[float]) -> list[float]:
        if not value or min(value) < 0 or len(set(value)) != len(value):
            raise ValueError(f"must be distinct temperatures >= 0, at least one, got {value}")
        return value

    @field_validator("spec_configs")
    @classmethod
    def _positive_configs(cls, value: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        bad = [c for c in value if min(c) < 1]
        if bad:
            raise ValueError(f"every (num_steps, topk, num_draft_tokens) must be >= 1, got {bad}")
        return value


class Profile(_Strict):
    profile: str = Field(description="the profile's name (its file stem)")
    run_root: str = Field(description="where every artifact of this profile is written")
    target: TargetConfig = Field(description="the verifier model")
    datasets: list[DatasetConfig] = Field(description="prompt and conversation datasets, one partition each")
    generation: GenerationConfig = Field(description="how raw_responses regenerates assistant turns")
    data: DataConfig = Field(DataConfig(), description="tokenize, merge and vocabulary settings")
    gpu_host: GpuHostConfig = Field(GpuHostConfig(), description="where GPU work runs")
    hidden: HiddenConfig = Field(description="hidden-state extraction and storage")
    drafter: DrafterOverrides = Field(DrafterOverrides(), description="the drafter's shape")
    train: TrainConfig = Field(TrainConfig(), description="drafter training")
    bench: BenchConfig = Field(BenchConfig(), description="benchmark_report")

    @field_validator("run_root")
    @classmethod
    def _local_run_root(cls, value: str) -> str:
        from eagle3_dagster.storage import is_remote

        if is_remote(value):  # append-only logs, byte-offset reads, torchrun checkpoints: a file system
            raise ValueError("must be a local folder; hidden.root and train.export_location may be object-store URLs")
        return value

    @model_validator(mode="before")
    @classmethod
    def _bench_temperatures(cls, data):
        """bench.temperatures defaults to greedy plus the temperature the profile generates at."""
        if not isinstance(data, dict):
            return data
        bench = data.get("bench")
        bench = bench.model_dump() if isinstance(bench, BaseModel) else dict(bench or {})
        if bench.get("temperatures") is None:
            gen = data.get("generation")
            t = gen.temperature if isinstance(gen, BaseModel) else (gen or {}).get("temperature", 0.0)
            bench["temperatures"] = [0.0] + ([float(t)] if t and float(t) > 0 else [])
            data = {**data, "bench": bench}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> "Profile":
        names = [d.name for d in self.datasets]
        seen: dict[str, int] = {}
        for i, name in enumerate(names):  # case-insensitively: A1 and a1 are one file on macOS and Windows
            if name.lower() in seen:
                raise ValueError(f"datasets[{i}].name: {name!r} is already the name of datasets[{seen[name.lower()]}] "
                                 f"({names[seen[name.lower()]]!r}); dataset names must be unique, ignoring case")
            seen[name.lower()] = i
        unknown = sorted(set(self.data.drop_datasets) - set(names))
        if unknown:
            raise ValueError(f"data.drop_datasets names datasets that are not configured: {unknown}")
        if self.hidden.aux_layers:
            # The targets are DeepSeek-V3 / Kimi-K2.5; a Llama target is checked again at export, from its config.
            from eagle3_dagster.sglang.releases import draft_aux_ids

            version = self.gpu_host.sglang_version
            try:
                draft_aux_ids(list(self.hidden.aux_layers), "deepseek", [version] if version else None)
            except ValueError as e:
                raise ValueError(f"hidden.aux_layers: {e}" + (" (gpu_host.sglang_version)" if version else "")) \
                    from None
        from eagle3_dagster.sglang.releases import EAGLE31_OPTIONS, release

        options = [o for o in EAGLE31_OPTIONS if getattr(self.drafter, o)]
        if options and self.gpu_host.sglang_version:  # refused before training, not at export after it

            served = release(self.gpu_host.sglang_version)
            if unread := [o for o in options if o not in served.eagle31_options]:
                raise ValueError(f"drafter.{', drafter.'.join(unread)}: gpu_host.sglang_version {served.version} does "
                                 "not read it from the draft config and would serve the drafter without it (SGLang "
                                 ">= 0.5.12 does)")
        return self

    @property
    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def dataset(self, name: str) -> DatasetConfig:
        for d in self.datasets:
            if d.name == name:
                return d
        raise KeyError(f"no dataset named {name!r} in profile {self.profile!r}")

    def path(self, *parts: str) -> Path:
        root = Path(self.run_root)
        if not root.is_absolute():
            root = PROJECT_ROOT / root
        return root.joinpath(*parts)


class ProfileError(ValueError):
    """A profile file that does not validate; the message names the file and each bad field."""


def _format_errors(source: Path, err: ValidationError) -> str:
    lines = [f"{source}: invalid profile"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {loc}: {e['msg']}")
    return "\n".join(lines)


def resolve_profile_path(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in {".yaml", ".yml"}:
        return candidate if candidate.is_absolute() else (Path.cwd() / candidate)
    return CONFIG_DIR / f"{name_or_path}.yaml"


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error: PyYAML keeps the last one, so a
    second `data:` block would silently replace the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key == "<<" or not isinstance(key, (str, int, float, bool)):  # merge keys may repeat
                    continue
                if key in seen:
                    raise _DuplicateKey(f"key {key!r} appears twice in one mapping (lines {seen[key]} and "
                                        f"{key_node.start_mark.line + 1}); the second would silently replace the "
                                        f"first: merge them into one")
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_profile_file(path: Path, overrides: dict | None = None) -> Profile:
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ProfileError(f"{path}: profile file not found (known profiles: {', '.join(known)})")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as e:
        raise ProfileError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: top level must be a mapping")
    if overrides:
        raw = _deep_merge(raw, overrides)
    try:
        return Profile.model_validate(raw)
    except ValidationError as e:
        raise ProfileError(_format_errors(path, e)) from None


def load_profile(name_or_path: str | None = None, overrides: dict | None = None) -> Profile:
    """Load the profile named by the argument, else by $EAGLE3_PROFILE, else `demo`."""
    chosen = name_or_path or os.environ.get(PROFILE_ENV_VAR) or DEFAULT_PROFILE
    return load_profile_file(resolve_profile_path(chosen), overrides)


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
