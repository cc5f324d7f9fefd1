"""The one typed configuration tree, loaded from a profile YAML in `configs/`.

Owns: the schema of every profile, its validation (unknown keys and bad values
are errors that name the file and the `section.field`), and the choice of the
profile from `EAGLE3_PROFILE`. It does not read the environment at import time:
`load_profile()` is called by whoever needs the config.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROFILE_ENV_VAR = "EAGLE3_PROFILE"
DEFAULT_PROFILE = "demo"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = PROJECT_ROOT / "configs"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyTargetConfig(_Strict):
    """The demo's target: a DeepSeek-V3 model small enough to pre-train on a CPU."""

    seed: int = 0
    vocab_size: int = Field(4096, ge=300, description="BPE vocabulary incl. special tokens")
    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_hidden_layers: int = Field(4, ge=2)
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 16
    v_head_dim: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    max_position_embeddings: int = 2048
    tokenizer_train_conversations: int = Field(3000, description="ShareGPT conversations the BPE is trained on")
    pretrain_tokens: int = Field(400_000, description="token budget of the pre-training run")
    pretrain_seq_len: int = 256
    pretrain_batch_size: int = 8
    pretrain_lr: float = 3e-3
    pretrain_answer_words: int | None = Field(
        None, ge=1, description="clip each assistant answer to this many words in pre-training, so the "
        "target learns to close its turns within the demo's generation budget"
    )


class TargetConfig(_Strict):
    kind: Literal["tiny", "external"] = Field(
        description="tiny: build the demo target locally; external: an existing model directory (GPU host)"
    )
    path: str | None = Field(None, description="model directory for kind=external (on the GPU host)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    serving_context: int = Field(
        2048, description="longest context the drafter is served at; sets the export's max_position_embeddings"
    )
    tiny: TinyTargetConfig = TinyTargetConfig()

    @model_validator(mode="after")
    def _path_for_external(self) -> "TargetConfig":
        if self.kind == "external" and not self.path:
            raise ValueError("target.path is required when target.kind is 'external'")
        return self


class DatasetConfig(_Strict):
    name: str = Field(description="partition key, e.g. A1_deepswekimi or sharegpt")
    source: Literal["sharegpt", "prompts_jsonl", "conversations_jsonl", "pretokenized_jsonl"] = Field(
        description="sharegpt: the bundled ShareGPT file; prompts_jsonl/conversations_jsonl: chat records; "
        "pretokenized_jsonl: records with input_ids + loss_mask"
    )
    path: str | None = Field(None, description="local file or hub dataset for the *_jsonl sources")
    regenerate: bool = Field(True, description="replace assistant turns with the target's own answers")
    max_conversations: int | None = Field(None, ge=1)
    max_turns: int = Field(8, ge=1, description="assistant turns regenerated per conversation at most")

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
    model: str | None = None
    api_key_env: str = Field("OPENROUTER_API_KEY", description="name of the environment variable holding the key")
    max_new_tokens: int = 256
    temperature: float = 0.0
    concurrency: int = Field(8, ge=1)
    max_retries: int = Field(6, ge=0)
    timeout_s: float = 120.0
    budget_usd: float | None = Field(None, description="stop cleanly once this much has been spent")
    reasoning: bool = Field(True, description="ask for and keep reasoning_content")
    reasoning_style: Literal["openrouter", "chat_template"] = Field(
        "openrouter", description="openrouter: `reasoning` request field; chat_template: SGLang/vLLM thinking kwarg"
    )
    resend_interrupted: bool = Field(
        False, description="re-send requests that were in flight when a run died (they may be paid twice)"
    )
    extra_body: dict = Field(default_factory=dict, description="merged into each request, e.g. provider pinning")

    @model_validator(mode="after")
    def _url_for_openai(self) -> "GenerationConfig":
        if self.backend == "openai" and not (self.base_url and self.model):
            raise ValueError("generation.base_url and generation.model are required for backend 'openai'")
        return self


class DataConfig(_Strict):
    max_seq_len: int = Field(8192, ge=16)
    shuffle_seed: int = 42
    drop_datasets: list[str] = Field(default_factory=list, description="datasets left out of merged_train")
    bad_fraction_threshold: float = Field(0.05, ge=0, le=1, description="tokenized_dataset fails above this")
    heldout_fraction: float = Field(0.05, ge=0, lt=1, description="conversations kept out of training")
    draft_vocab_size: int = Field(32000, ge=1)


class GpuHostConfig(_Strict):
    transport: Literal["local", "ssh"] = "local"
    ssh_target: str | None = Field(None, description="user@host for transport=ssh")
    ssh_options: list[str] = Field(default_factory=list)
    python: str = Field("python", description="the interpreter on the host (SGLang's environment)")
    workdir: str = Field(".eagle3/gpu_host", description="working folder on the host")
    num_gpus: int = 0

    @model_validator(mode="after")
    def _target_for_ssh(self) -> "GpuHostConfig":
        if self.transport == "ssh" and not self.ssh_target:
            raise ValueError("gpu_host.ssh_target is required for transport 'ssh'")
        return self


class HiddenConfig(_Strict):
    backend: Literal["hf", "sglang"] = "hf"
    aux_layers: list[int] | None = Field(
        None, description="canonical numbering (HF output_hidden_states index); default [2, L//2, L-3]"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    root: str = Field(description="hidden-states root; one folder per version below it")
    samples_per_shard: int = Field(256, ge=1)
    batch_tokens: int = Field(4096, ge=16, description="hf backend: tokens per length-bucketed batch")
    throughput_tokens_per_s: float = Field(2000.0, gt=0, description="for the plan's time estimate")
    tp_size: int = 1
    sglang_port: int = 30000
    sglang_concurrency: int = Field(8, ge=1, description="prefill requests in flight during extraction")
    backfill_batch: int = Field(4, ge=1, description="shard partitions the backfill schedule requests per tick")
    backfill_cron: str = Field("*/10 * * * *", description="when the backfill schedule looks for missing shards")
    max_runtime_s: int = Field(6 * 3600, ge=60, description="a shard run longer than this is cancelled")


class DrafterConfig(_Strict):
    hidden_size: int | None = Field(None, description="default: the target's hidden size")
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None


class TrainConfig(_Strict):
    ttt_steps: int = Field(7, ge=1)
    epochs: int = 1
    max_steps: int | None = None
    lr: float = 1e-4
    warmup_ratio: float = 0.02
    batch_tokens: int = 4096
    grad_accum: int = 1
    grad_clip: float = 0.5
    checkpoint_every: int = 200
    seed: int = 0
    nproc_per_node: int = 1
    nnodes: int = 1
    backend: Literal["gloo", "nccl"] = "gloo"


class BenchConfig(_Strict):
    spec_configs: list[tuple[int, int, int]] = Field(
        default_factory=lambda: [(3, 1, 4), (7, 1, 8)], description="(num_steps, topk, num_draft_tokens)"
    )
    num_prompts: int = 20
    max_new_tokens: int = 64
    sets: list[str] = Field(default_factory=lambda: ["heldout_sharegpt"])
    set_paths: dict[str, str] = Field(
        default_factory=dict, description="local jsonl/parquet per prompt set (tool_use has no hub copy)"
    )
    max_prompt_tokens: int | None = Field(None, description="prompts longer than this are left out")
    concurrency: int = Field(8, ge=1, description="served benchmark: requests in flight")
    ngram_max: int = Field(3, ge=1, description="n-gram baseline: longest n-gram looked up in the context")


class Profile(_Strict):
    profile: str
    run_root: str = Field(description="where every artifact of this profile is written")
    target: TargetConfig
    datasets: list[DatasetConfig]
    generation: GenerationConfig
    data: DataConfig = DataConfig()
    gpu_host: GpuHostConfig = GpuHostConfig()
    hidden: HiddenConfig
    drafter: DrafterConfig = DrafterConfig()
    train: TrainConfig = TrainConfig()
    bench: BenchConfig = BenchConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> "Profile":
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"datasets: names must be unique, got {names}")
        unknown = sorted(set(self.data.drop_datasets) - set(names))
        if unknown:
            raise ValueError(f"data.drop_datasets names datasets that are not configured: {unknown}")
        return self

    @property
    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def dataset(self, name: str) -> DatasetConfig:
        for d in self.datasets:
            if d.name == name:
                return d
        raise KeyError(f"no dataset named {name!r} in profile {self.profile!r}")

    def fingerprint(self, *sections: str) -> str:
        """Stable hash of some sections; part of each asset's code version, so a changed config marks it stale."""
        h = hashlib.sha256()
        for section in sections:
            value = getattr(self, section)
            payload = value.model_dump_json() if hasattr(value, "model_dump_json") else \
                "[" + ",".join(v.model_dump_json() for v in value) + "]"
            h.update(section.encode() + b"\0" + payload.encode() + b"\0")
        return h.hexdigest()[:12]

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


def load_profile_file(path: Path, overrides: dict | None = None) -> Profile:
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ProfileError(f"{path}: profile file not found (known profiles: {', '.join(known)})")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
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
