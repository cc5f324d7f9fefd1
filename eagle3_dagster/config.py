"""The one typed configuration tree, loaded from a profile YAML in `configs/`.

Owns: the schema of every profile, its validation (unknown keys and bad values
are errors that name the file and the `section.field`), which of its locations must be
local folders (what a location is belongs to `storage`), and the choice of the
profile from `EAGLE3_PROFILE`. It does not read the environment at import time:
`load_profile()` is called by whoever needs the config.
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator
from pydantic.fields import (
    PydanticUndefined,
)  # pydantic re-exports it: the GPU host installs pydantic, not pydantic-core by name

from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang_releases import (
    EAGLE31_OPTIONS,
    UnsupportedRelease,
    refused_extraction_option,
    release,
    served_drafter_problem,
)
from eagle3_dagster.storage import StorageSettings, location
from eagle3_dagster.url_secrets import url_credentials

PROFILE_ENV_VAR = "EAGLE3_PROFILE"
DEFAULT_PROFILE = "demo"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = PROJECT_ROOT / "configs"


# Cron syntax as Dagster reads it (five fields, names, ranges, steps, `L` for the last day of the month,
# @-aliases). Checked here because the engine may not import Dagster and croniter is not a dependency; a
# test compares this with Dagster's own `is_valid_cron_string`.
_CRON_ALIASES = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
_CRON_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")),
    ("day of week", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)


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
                value = (
                    names.index(b) + (1 if name == "month" else 0) if b in names else (int(b) if b.isdigit() else None)
                )
                if value is None or not lo <= value <= hi:
                    return f"{name}: {b!r} is not in {lo}-{hi}"
    return None


def _profile_strings(value, path: str):
    """(dotted path, string) of every string in a profile value: fields, list items, mapping values."""
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _profile_strings(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _profile_strings(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _profile_strings(item, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def _a_folder(value: str) -> str:
    """`value` unless it names no folder (empty) or the file system's root, where a stage would create and (when
    superseded, hidden.root) delete its folders among the system's own."""
    if not value.strip():
        raise ValueError("is empty; name the folder this profile writes to")
    scheme, sep, rest = value.partition("://")
    local = rest if sep and scheme in ("file", "local") else None if sep else value  # None: an object store
    if local is not None and os.path.normpath(PROJECT_ROOT / local) == os.sep:
        raise ValueError(
            f"{value!r} is the file system's root; name a folder of this profile's own "
            "(its stages create folders in it, and remove superseded ones)"
        )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Every number in a profile has a lower and an upper bound, and the reason for them: a value outside is
# refused when the profile loads with that reason (`_format_errors`), instead of overflowing or running for
# years somewhere downstream. `tests/unit/test_profile_fields.py` fails for a number without both.
def _bounded(default=PydanticUndefined, *, why: str, **field):
    """A pydantic Field whose bounds (ge/gt/le/lt in `field`) have the reason `why`, quoted on a refusal."""
    return Field(default, json_schema_extra={"bounds": why}, **field)


WHY_SEED = "seeds are 32-bit (numpy's generator takes at most 2**32 - 1)"
WHY_TINY = (
    "the tiny target is built and pre-trained on a CPU; a model this large is an external target "
    "(target.kind: external)"
)
WHY_WIDTH = "wider than any released target (DeepSeek-V3 and Kimi-K2.5: hidden 7168, 128 heads, MLP 18432)"
WHY_TOKENS = "tokens in one sequence or batch: 16x Kimi-K2.5's 262,144-token context"
WHY_FRACTION = "a share of the records, between 0 and 1"
WHY_LR = "a learning rate above 1 diverges at once"
WHY_TEMPERATURE = "sampling temperatures of OpenAI-compatible servers lie in [0, 2]"
WHY_CONCURRENCY = "requests in flight at once: more than a server or client connection pool takes"
WHY_COUNT = "no run of this pipeline comes near it: a larger number is a typo"
WHY_WAIT = "longer than a run may last (dagster.yaml's run_monitoring.max_runtime_seconds is 3 days)"
MAX_RUN_S = 3 * 86400  # dagster_home/dagster.yaml run_monitoring.max_runtime_seconds
WHY_RETRIES = "more tries than this only delay the error; a store or server that fails this often is down"


class TinyTargetConfig(_Strict):
    """The demo's target: a DeepSeek-V3 model small enough to pre-train on a CPU."""

    seed: int = _bounded(
        0,
        ge=0,
        le=2**32 - 1,
        why=WHY_SEED,
        description="seed of the tokenizer training, the weights and the pre-training",
    )
    vocab_size: int = _bounded(4096, ge=300, le=2**18, why=WHY_TINY, description="BPE vocabulary incl. special tokens")
    hidden_size: int = _bounded(128, ge=8, le=4096, why=WHY_TINY, description="model width H")
    intermediate_size: int = _bounded(256, ge=1, le=16384, why=WHY_TINY, description="MLP width of the dense layers")
    moe_intermediate_size: int = _bounded(64, ge=1, le=16384, why=WHY_TINY, description="MLP width of each expert")
    num_hidden_layers: int = _bounded(4, ge=2, le=128, why=WHY_TINY, description="decoder layers L")
    num_attention_heads: int = _bounded(4, ge=1, le=128, why=WHY_TINY, description="attention heads (MLA)")
    q_lora_rank: int = _bounded(64, ge=1, le=4096, why=WHY_TINY, description="MLA query low-rank dimension")
    kv_lora_rank: int = _bounded(32, ge=1, le=4096, why=WHY_TINY, description="MLA key/value low-rank dimension")
    qk_rope_head_dim: int = _bounded(
        16, ge=2, le=1024, why=WHY_TINY, description="MLA rotary part of each query/key head"
    )
    qk_nope_head_dim: int = _bounded(
        16, ge=1, le=1024, why=WHY_TINY, description="MLA non-rotary part of each query/key head"
    )
    v_head_dim: int = _bounded(32, ge=1, le=1024, why=WHY_TINY, description="MLA value head dimension")
    n_routed_experts: int = _bounded(8, ge=1, le=1024, why=WHY_TINY, description="routed experts per MoE layer")
    num_experts_per_tok: int = _bounded(2, ge=1, le=1024, why=WHY_TINY, description="experts each token is routed to")
    n_shared_experts: int = _bounded(1, ge=0, le=64, why=WHY_TINY, description="always-active experts per MoE layer")
    first_k_dense_replace: int = _bounded(
        1, ge=0, le=128, why=WHY_TINY, description="leading layers with a dense MLP instead of MoE"
    )
    max_position_embeddings: int = _bounded(
        2048, ge=16, le=2**22, why=WHY_TOKENS, description="longest context the tiny target supports"
    )
    tokenizer_train_conversations: int = _bounded(
        3000,
        ge=1,
        le=10**7,
        why="more conversations than the bundled ShareGPT file has (about 94,000)",
        description="ShareGPT conversations the BPE is trained on",
    )
    pretrain_tokens: int = _bounded(
        400_000,
        ge=1,
        le=10**10,
        why="pre-training runs on a CPU, where 10**10 tokens take months",
        description="token budget of the pre-training run",
    )
    pretrain_seq_len: int = _bounded(
        256, ge=8, le=2**22, why=WHY_TOKENS, description="tokens per pre-training sequence"
    )
    pretrain_batch_size: int = _bounded(8, ge=1, le=4096, why=WHY_TINY, description="sequences per pre-training step")
    pretrain_lr: float = _bounded(3e-3, gt=0, le=1, why=WHY_LR, description="peak learning rate of the pre-training")
    pretrain_answer_words: int | None = _bounded(
        None,
        ge=1,
        le=10**6,
        why=WHY_COUNT,
        description="clip each assistant answer to this many words in "
        "pre-training, so the target learns to close its turns within the demo's generation budget",
    )


class TargetConfig(_Strict):
    kind: Literal["tiny", "external"] = Field(
        description="tiny: build the demo target locally; external: an existing model directory (GPU host)"
    )
    path: str | None = Field(None, description="model directory for kind=external (on the GPU host)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype the target is loaded in")
    trust_remote_code: bool = Field(
        False,
        description="let transformers run Python code shipped with the target's checkpoint (Kimi-K2.5 "
        "needs it for its tokenizer); off unless the profile turns it on",
    )
    reviewed_code: dict[str, str] | None = Field(
        None,
        description="the target's code as reviewed: file name (relative to the target folder) -> sha256 "
        "of every *.py there and each module an auto_map names (the target_model asset lists them as code_files). "
        "Set, and with trust_remote_code on, a code file not listed or with another hash is refused before any "
        "code runs",
    )
    serving_context: int = _bounded(
        2048,
        ge=16,
        le=2**22,
        why=WHY_TOKENS,
        description="longest context the drafter is served at; sets the export's max_position_embeddings",
    )
    tiny: TinyTargetConfig = Field(TinyTargetConfig(), description="the demo target's shape (kind=tiny)")

    @field_validator("reviewed_code")
    @classmethod
    def _sha256_values(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        bad = [name for name, digest in (value or {}).items() if not re.fullmatch(r"[0-9a-f]{64}", digest)]
        if bad:
            raise ValueError(f"target.reviewed_code: {bad} not a sha256 (64 lowercase hex digits)")
        return value

    @model_validator(mode="after")
    def _path_for_external(self) -> "TargetConfig":
        if self.kind == "external" and not self.path:
            raise ValueError("target.path is required when target.kind is 'external'")
        return self


# A dataset name is a Dagster partition key and a path component of every file of its partitions: one safe
# alphabet, so no name can climb out of run_root (`../x`) or land on another dataset's files.
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class DatasetConfig(_Strict):
    name: str = Field(
        description="partition key and file-name part, e.g. A1_deepswekimi or sharegpt: letters, "
        "digits, '_' and '-', starting with a letter or digit, at most 64 characters"
    )
    source: Literal["sharegpt", "prompts_jsonl", "conversations_jsonl", "pretokenized_jsonl"] = Field(
        description="sharegpt: the bundled ShareGPT file; prompts_jsonl/conversations_jsonl: chat records; "
        "pretokenized_jsonl: records with input_ids + loss_mask"
    )
    path: str | None = Field(None, description="local file or hub dataset for the *_jsonl sources")
    regenerate: bool = Field(True, description="replace assistant turns with the target's own answers")
    max_conversations: int | None = _bounded(
        None, ge=1, le=10**9, why=WHY_COUNT, description="use at most this many conversations"
    )
    max_turns: int = _bounded(
        8, ge=1, le=10_000, why=WHY_COUNT, description="assistant turns regenerated per conversation at most"
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not DATASET_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a dataset name: use letters, digits, '_' and '-' (starting with a "
                "letter or digit, at most 64 characters); the name is a partition key and part of "
                "file names under run_root"
            )
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
    max_new_tokens: int = _bounded(
        256,
        ge=1,
        le=1_000_000,
        why="more than any served model generates in one answer",
        description="completion tokens per request at most",
    )
    temperature: float = _bounded(0.0, ge=0, le=2, why=WHY_TEMPERATURE, description="sampling temperature; 0 is greedy")
    concurrency: int = _bounded(8, ge=1, le=4096, why=WHY_CONCURRENCY, description="requests in flight")
    max_retries: int = _bounded(
        6, ge=0, le=100, why=WHY_RETRIES, description="retries of a request after a retryable failure"
    )
    timeout_s: float = _bounded(
        120.0, gt=0, le=86400, why="a request that takes a day has failed", description="seconds one request may take"
    )
    budget_usd: float | None = _bounded(
        None,
        gt=0,
        le=1_000_000,
        why="a spend cap of a million dollars per partition is a typo",
        description="spend cap of a partition: a request is sent only when its worst-case cost "
        "(see price_usd_per_completion_token) still fits, so the cap holds at any concurrency",
    )
    price_usd_per_completion_token: float | None = _bounded(
        None,
        ge=0,
        le=1,
        why="no model charges a dollar per token",
        description="the model's price of one completion token (USD), at least what the "
        "provider charges: each request reserves max_new_tokens x this before it is sent; needed with budget_usd",
    )
    price_usd_per_prompt_token: float = _bounded(
        0.0,
        ge=0,
        le=1,
        why="no model charges a dollar per token",
        description="the model's price of one prompt token (USD); the reservation bounds a "
        "prompt's tokens by its UTF-8 bytes",
    )
    max_failure_fraction: float = _bounded(
        0.05,
        ge=0,
        le=1,
        why=WHY_FRACTION,
        description="raw_responses fails when more of a run's requests than this fail for good",
    )
    reasoning: bool = Field(True, description="ask for and keep reasoning_content")
    reasoning_style: Literal["openrouter", "chat_template"] = Field(
        "openrouter", description="openrouter: `reasoning` request field; chat_template: SGLang/vLLM thinking kwarg"
    )
    resend_interrupted: bool = Field(
        False,
        description="re-send requests whose answer was lost after they may have reached the provider: in "
        "flight when a run died, or timed out (they may be paid twice)",
    )
    extra_body: dict = Field(default_factory=dict, description="merged into each request, e.g. provider pinning")

    @model_validator(mode="after")
    def _url_for_openai(self) -> "GenerationConfig":
        if self.backend == "openai" and not (self.base_url and self.model):
            raise ValueError("generation.base_url and generation.model are required for backend 'openai'")
        if self.backend == "openai" and self.budget_usd is not None and self.price_usd_per_completion_token is None:
            raise ValueError(
                "generation.price_usd_per_completion_token is required when generation.budget_usd is "
                "set: each request reserves max_new_tokens x this price before it is sent"
            )
        return self


class DataConfig(_Strict):
    max_seq_len: int = _bounded(
        8192,
        ge=16,
        le=2**20,
        why="tokens per sample: 4x Kimi-K2.5's 262,144-token context",
        description="tokens per training sample at most; longer ones are cut",
    )
    shuffle_seed: int = _bounded(42, ge=0, le=2**32 - 1, why=WHY_SEED, description="seed of merged_train's shuffle")
    drop_datasets: list[str] = Field(default_factory=list, description="datasets left out of merged_train")
    bad_fraction_threshold: float = _bounded(
        0.05, ge=0, le=1, why=WHY_FRACTION, description="tokenized_dataset fails above this"
    )
    heldout_fraction: float = _bounded(
        0.05,
        ge=0,
        lt=1,
        why="a share of the conversations; all of them held out leaves nothing to train on",
        description="conversations kept out of training",
    )
    draft_vocab_size: int = _bounded(
        32000,
        ge=1,
        le=2**24,
        why="larger than any target's vocabulary (Kimi-K2.5: 163,840)",
        description="tokens in the drafter's vocabulary",
    )


class HostsConfig(_Strict):
    """The GPU hosts, always a list (one host: a one-element list), and how a run leases one. The Dagster
    resource `gpu_host` is this class (resources/gpu_host.py), its hosts made Dagster config."""

    hosts: list[HostConfig] = Field(
        default_factory=lambda: [HostConfig()],
        min_length=1,
        description="the GPU hosts; each hidden_states run leases one, and the gpu_host pool gets one slot per "
        "host. Default: this machine, with the interpreter that runs the pipeline",
    )
    lease_dir: str | None = Field(
        None,
        description="where the per-host lease files are locked (flock); must be one folder seen by every "
        "run worker of the instance. Unset: gpu_host_leases under the Dagster instance's storage",
    )
    lease_wait_s: float = _bounded(
        600.0,
        ge=0,
        le=MAX_RUN_S,
        why=WHY_WAIT,
        description="how long a run waits for a host leased by another run before it fails",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_flat_host(cls, raw):
        """A host's fields directly under `gpu_host` (the one-host form of earlier profiles) are refused with
        the list to write instead: two spellings of one host is what `hosts` replaced."""
        flat = sorted(set(HostConfig.model_fields) & set(raw)) if isinstance(raw, dict) else []
        if not flat:
            return raw
        where = f"{', '.join('gpu_host.' + k for k in flat)}: a host's fields go in the list gpu_host.hosts"
        if "hosts" in raw:
            raise ValueError(f"{where}: set {', '.join(flat)} in each host that needs it")
        host = {k: v for k, v in raw.items() if k in flat}  # in the profile's order
        rest = {k: v for k, v in raw.items() if k not in flat}
        block = yaml.safe_dump({"gpu_host": {"hosts": [host], **rest}}, sort_keys=False)
        raise ValueError(f"{where} (one element for one host); write instead:\n{block}")

    @model_validator(mode="after")
    def _unique_names(self) -> "HostsConfig":
        labels = [h.label for h in self.hosts]
        twice = sorted({n for n in labels if labels.count(n) > 1})
        if twice:
            raise ValueError(f"gpu_host.hosts: names must be unique, {twice} name several hosts; give each a `name`")
        return self


class GpuHostConfig(HostsConfig):
    """The profile's `gpu_host`: the hosts, and the SGLang release installed on them."""

    sglang_version: str | None = Field(
        None,
        description="the SGLang release on the host (patches/sglang/README.md); the drafter export's aux "
        "ids are written for it; unset: ids right on every supported release that can express the aux layers",
    )

    @model_validator(mode="after")
    def _known_release(self) -> "GpuHostConfig":
        if self.sglang_version is not None:
            try:
                release(self.sglang_version)
            except UnsupportedRelease as e:
                raise ValueError(f"gpu_host.sglang_version: {e}") from None
        return self


class HiddenConfig(_Strict):
    backend: Literal["hf", "sglang"] = Field("hf", description="hf: transformers (CPU or GPU); sglang: patched server")
    aux_layers: list[Annotated[int, Field(ge=0, le=1024)]] | None = _bounded(
        None,
        why="layer numbers of a model: 0 (the embedding) up to more layers than any released model has",
        description="canonical numbering (HF output_hidden_states index); default [2, L//2, L-3]",
    )
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3fn"] = Field(
        "float32",
        description="dtype of the stored states; float8_e4m3fn stores fp8 with one scale per token row "
        "of each state, about half the bytes of bfloat16",
    )
    root: str = Field(
        description="hidden-states root, one folder per version below it: a local path or an "
        "fsspec URL (s3://bucket/prefix, gs://…; credentials and endpoint from the environment)"
    )
    staging_dir: str | None = Field(
        None,
        description="local folder where shards are written and checked before upload when hidden.root is a "
        "URL (holds only the shards in flight); default <run_root>/hidden_staging",
    )
    samples_per_shard: int = _bounded(
        256,
        ge=1,
        le=2**20,
        why="one shard is one partition, written and uploaded whole: a million samples at production width "
        "is terabytes",
        description="samples per shard (one partition each)",
    )
    batch_tokens: int = _bounded(
        4096, ge=16, le=2**22, why=WHY_TOKENS, description="hf backend: tokens per length-bucketed batch"
    )
    throughput_tokens_per_s: float = _bounded(
        2000.0, gt=0, le=10**9, why="faster than any host prefills", description="for the plan's time estimate"
    )
    tp_size: int = _bounded(
        1, ge=1, le=1024, why="more GPUs than one server spans", description="SGLang tensor-parallel size"
    )
    sglang_port: int = _bounded(
        30000, ge=1, le=65535, why="TCP ports are 1-65535", description="port of the SGLang server on the GPU host"
    )
    sglang_concurrency: int = _bounded(
        8, ge=1, le=4096, why=WHY_CONCURRENCY, description="prefill requests in flight during extraction"
    )
    sglang_server_args: list[str] = Field(
        default_factory=list,
        description="extra options for the SGLang server on the GPU host, after the "
        "release's own, for extraction and the served benchmark alike (e.g. --mem-fraction-static 0.85; a CPU "
        "host: --device cpu --attention-backend torch_native); options that would store other states or skip "
        "rows (radix/hierarchical cache, mixed chunks, ...) are refused",
    )
    backfill_batch: int = _bounded(
        4,
        ge=1,
        le=1000,
        why="runs one automation tick puts on the queue: more would swamp the run queue",
        description="shard partitions the hidden_states automation requests per tick",
    )
    backfill_cron: str = Field(
        "*/10 * * * *", description="when the hidden_states automation looks for missing or failed shards"
    )
    max_runtime_s: int = _bounded(
        6 * 3600,
        ge=60,
        le=MAX_RUN_S,
        why="the instance cancels any run after run_monitoring.max_runtime_seconds (3 days, dagster.yaml)",
        description="a shard run longer than this is cancelled",
    )

    @field_validator("sglang_server_args")
    @classmethod
    def _extraction_options(cls, value: list[str]) -> list[str]:
        if (why := refused_extraction_option(value)) is not None:
            raise ValueError(why)
        return value

    @field_validator("staging_dir")
    @classmethod
    def _local_staging(cls, value: str | None) -> str | None:
        if value is not None:
            _a_folder(value)
            try:
                location(value).local_path()
            except ValueError:
                raise ValueError(
                    f"must be a local folder (shards are written there before upload), got {value!r}"
                ) from None
        return value

    @field_validator("root")
    @classmethod
    def _root_location(cls, value: str) -> str:
        _a_folder(value)
        location(value)  # a URL carrying credentials is refused
        return value

    @field_validator("backfill_cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        problem = cron_problem(value)
        if problem:
            raise ValueError(f"not a cron schedule Dagster accepts ({problem}): {value!r}")
        return value


# The MLA drafter's dimensions (drafter.attention: mla), each defaulting to the target's config.json value.
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class DrafterOverrides(_Strict):
    attention: Literal["gqa", "mla"] = Field(
        "gqa",
        description="gqa: a Llama decoder layer with grouped-query attention (SGLang's "
        "LlamaForCausalLMEagle3); mla: DeepSeek's multi-latent attention, the layer of Kimi's served drafters "
        "(SGLang >= 0.5.12 Eagle3DeepseekV2ForCausalLM), whose draft KV cache holds kv_lora_rank + "
        "qk_rope_head_dim values per token",
    )
    hidden_size: int | None = _bounded(
        None, ge=8, le=65536, why=WHY_WIDTH, description="default: the target's hidden size"
    )
    intermediate_size: int | None = _bounded(
        None, ge=1, le=2**18, why=WHY_WIDTH, description="MLP width; default: the target's"
    )
    num_attention_heads: int | None = _bounded(
        None, ge=1, le=1024, why=WHY_WIDTH, description="attention heads; default: the target's"
    )
    num_key_value_heads: int | None = _bounded(
        None, ge=1, le=1024, why=WHY_WIDTH, description="key/value heads; default: attention heads"
    )
    q_lora_rank: int | None = _bounded(
        None, ge=1, le=65536, why=WHY_WIDTH, description="MLA query low-rank dimension; default: the target's"
    )
    kv_lora_rank: int | None = _bounded(
        None, ge=1, le=65536, why=WHY_WIDTH, description="MLA key/value latent dimension; default: the target's"
    )
    qk_nope_head_dim: int | None = _bounded(
        None,
        ge=1,
        le=4096,
        why=WHY_WIDTH,
        description="MLA non-rotary part of each query/key head; default: the target's",
    )
    qk_rope_head_dim: int | None = _bounded(
        None,
        ge=2,
        le=4096,
        why=WHY_WIDTH,
        description="MLA rotary part of each query/key head (even); default: the target's",
    )
    v_head_dim: int | None = _bounded(
        None, ge=1, le=4096, why=WHY_WIDTH, description="MLA value head dimension; default: the target's"
    )
    fc_norm: bool = Field(
        False,
        description="EAGLE 3.1: an RMSNorm on each captured target state before fc (served "
        "by SGLang >= 0.5.12 and vLLM, which read config.json `fc_norm`; refused for older releases)",
    )
    norm_output: bool = Field(
        False,
        description="EAGLE 3.1: the next draft step gets the normed output, not the "
        "pre-norm sum (config.json `norm_output`; SGLang >= 0.5.12 and vLLM)",
    )

    @model_validator(mode="after")
    def _attention_fields(self) -> "DrafterOverrides":
        if self.attention == "gqa" and (given := [d for d in MLA_DIMS if getattr(self, d) is not None]):
            raise ValueError(
                f"drafter.{given[0]}: set, but only drafter.attention: mla uses it; remove it or set "
                "drafter.attention: mla"
            )
        if self.attention == "mla" and self.num_key_value_heads is not None:
            raise ValueError(
                "drafter.num_key_value_heads: MLA shares one key/value latent across all heads; remove "
                "it (drafter.attention is mla)"
            )
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            raise ValueError(f"drafter.qk_rope_head_dim: {self.qk_rope_head_dim} is odd; RoPE rotates pairs")
        return self

    @model_serializer(mode="wrap")
    def _omit_mla_defaults(self, handler):
        """`attention` and the MLA dimensions are written only when set: a job or profile from before they
        existed dumps (and so hashes: the run folder, drafter_checkpoint's code version) as it did."""
        data = handler(self)
        if isinstance(data, dict):
            if data.get("attention") == "gqa":
                del data["attention"]
            for key in [d for d in MLA_DIMS if d in data and data[d] is None]:
                del data[key]
        return data


class TrainConfig(_Strict):
    ttt_steps: int = _bounded(
        7,
        ge=1,
        le=64,
        why="each step is a forward pass of the drafter kept for the backward pass; served drafts use under 16",
        description="training-time-test unroll steps k",
    )
    epochs: int = _bounded(1, ge=1, le=1000, why=WHY_COUNT, description="passes over the hidden states")
    max_steps: int | None = _bounded(
        None, ge=1, le=10**9, why=WHY_COUNT, description="stop after this many optimizer steps"
    )
    lr: float = _bounded(1e-4, gt=0, le=1, why=WHY_LR, description="peak learning rate")
    warmup_ratio: float = _bounded(
        0.02,
        ge=0,
        lt=1,
        why="a share of the steps; all of them warming up never reaches the peak",
        description="share of the steps spent warming up",
    )
    batch_tokens: int = _bounded(
        4096, ge=16, le=2**22, why=WHY_TOKENS, description="padded tokens per micro-batch and rank"
    )
    grad_accum: int = _bounded(1, ge=1, le=4096, why=WHY_COUNT, description="micro-batches per optimizer step")
    grad_clip: float = _bounded(
        0.5, gt=0, le=10**4, why="a clip this high never clips a drafter's gradient", description="gradient norm clip"
    )
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = _bounded(
        (0.9, 0.95), why="AdamW's moment decay rates lie in [0, 1)", description="AdamW (beta1, beta2)"
    )
    loss: Literal["kl", "lk_lambda"] = Field(
        "kl",
        description="kl: forward KL to the target (EAGLE-3); lk_lambda: SpecForge's LK lambda objective, "
        "per TTT step λ·KL + (1 - λ)(1 - acceptance), λ = lk_kl_scale · exp(-lk_kl_decay · acceptance), "
        "acceptance = E[min(p_target, q_draft)] (arXiv 2602.23881)",
    )
    lk_kl_scale: float = _bounded(
        1.0,
        ge=0,
        le=1,
        why="a weight of the KL term, between 0 and 1 (SpecForge)",
        description="lk_lambda: the KL weight at zero acceptance",
    )
    lk_kl_decay: float = _bounded(
        1.0,
        ge=0,
        le=100,
        why="exp(-100 x acceptance) is 0 for any acceptance the drafter reaches",
        description="lk_lambda: how fast the KL weight falls as acceptance rises",
    )
    eval_fraction: float = _bounded(
        0.02,
        ge=0,
        lt=0.5,
        why="at least half of the samples are trained on",
        description="share of the hidden-state samples (chosen by a hash of the sample id, "
        "the same for every recipe) kept out of training; the drafter's reported acc_j and simulated acceptance "
        "are measured on them. 0: measured on training batches instead (flattering)",
    )
    checkpoint_every: int = _bounded(
        200, ge=1, le=10**9, why=WHY_COUNT, description="optimizer steps between checkpoints"
    )
    seed: int = _bounded(0, ge=0, le=2**32 - 1, why=WHY_SEED, description="seed of the drafter's init and the sampler")
    nproc_per_node: int = _bounded(
        1, ge=1, le=1024, why="more GPUs than one node has", description="torchrun workers per node"
    )
    nnodes: int = _bounded(
        1,
        ge=1,
        le=1024,
        why="more nodes than a drafter training uses",
        description="torchrun nodes: drafter_checkpoint leases this many hosts of gpu_host.hosts (at least as "
        "many must be listed) and starts torchrun on each; the hosts share the run_root file system",
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of the c10d rendezvous every node joins. Unset: with nnodes > 1, the first "
        "leased host's ssh target host name (127.0.0.1 for a local host) and a port free there at launch, that "
        "host's torchrun hosting the store (set this when the other hosts cannot reach that name, e.g. an ssh "
        "alias); with one node, a standalone rendezvous",
    )
    rdzv_id: str = Field("eagle3-drafter", min_length=1, description="rendezvous id shared by the nodes of one run")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="torch.distributed backend")
    export_location: str | None = Field(
        None,
        description="where the checked drafter export is also published, one folder per training run: a "
        "local path or an fsspec URL (s3://bucket/prefix; credentials from the environment); unset: the run "
        "folder only",
    )

    @field_validator("export_location")
    @classmethod
    def _export_location(cls, value: str | None) -> str | None:
        if value is not None:
            _a_folder(value)
            location(value)  # a URL carrying credentials is refused
        return value

    @model_validator(mode="after")
    def _rendezvous(self) -> "TrainConfig":
        if self.rdzv_endpoint and not re.fullmatch(r"[^\s:]+:\d{1,5}", self.rdzv_endpoint):
            raise ValueError(f"train.rdzv_endpoint: expected host:port, got {self.rdzv_endpoint!r}")
        return self


_DraftCount = Annotated[int, Field(ge=1, le=1024)]  # one of (num_steps, topk, num_draft_tokens)


class BenchConfig(_Strict):
    mode: Literal["inprocess", "served"] = Field(
        "inprocess",
        description="inprocess: the target and the drafter in the benchmark's own process (a CPU "
        "target); served: SGLang on the GPU host, started with and without the drafter (`gpu_host`)",
    )
    spec_configs: list[tuple[_DraftCount, _DraftCount, _DraftCount]] = _bounded(
        default_factory=lambda: [(3, 1, 4), (7, 1, 8)],
        why="more draft steps, branches or tokens than a server verifies in one pass",
        description="(num_steps, topk, num_draft_tokens)",
    )
    num_prompts: int = _bounded(20, ge=1, le=10**6, why=WHY_COUNT, description="prompts per set")
    max_new_tokens: int = _bounded(64, ge=1, le=2**22, why=WHY_TOKENS, description="tokens generated per prompt")
    sets: list[str] = Field(default_factory=lambda: ["heldout_sharegpt"], description="prompt sets to measure")
    set_paths: dict[str, str] = Field(
        default_factory=dict, description="local jsonl/parquet per prompt set (tool_use has no hub copy)"
    )
    max_prompt_tokens: int | None = _bounded(
        None, ge=1, le=2**22, why=WHY_TOKENS, description="prompts longer than this are left out"
    )
    concurrency: int = _bounded(
        8, ge=1, le=4096, why=WHY_CONCURRENCY, description="served benchmark: requests in flight"
    )
    ngram_max: int = _bounded(
        3,
        ge=1,
        le=64,
        why="an n-gram this long never recurs in a prompt",
        description="n-gram baseline: longest n-gram looked up in the context",
    )
    temperatures: list[Annotated[float, Field(ge=0, le=2)]] = _bounded(
        default_factory=lambda: [0.0],
        why=WHY_TEMPERATURE,
        description="in-process benchmark: temperatures to measure at (0 = greedy); each T > 0 uses "
        "speculative sampling with SGLang's lossless rule. Default: 0 and generation.temperature when above 0",
    )

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, value: list[float]) -> list[float]:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"must be distinct temperatures, at least one, got {value}")
        return value


class StorageConfig(_Strict):
    """How an object store (hidden.root or train.export_location as an s3:// URL) is waited for.

    Each request to the store is tried at most `attempts` times by botocore (its standard retry mode:
    connection errors, timeouts, 5xx and throttling), each try waiting at most `connect_timeout_s` for the
    connection and `read_timeout_s` for each read of the answer; s3fs's own retry loops are off, since they
    would multiply those tries (25 tries of a read in s3fs 2026.9). A store that stops answering is an
    error naming the object after at most `storage.wait_bound_s` (attempts x (connect + read) plus
    botocore's backoff), with a progress line every `progress_every_s` while the call waits."""

    connect_timeout_s: float = _bounded(
        StorageSettings.connect_timeout_s,
        gt=0,
        le=600,
        why="a connection not made in 10 minutes will not be made",
        description="seconds a try waits for a connection to the store (botocore connect_timeout)",
    )
    read_timeout_s: float = _bounded(
        StorageSettings.read_timeout_s,
        gt=0,
        le=3600,
        why="a store silent for an hour is down",
        description="seconds a try waits for each read of the store's answer (botocore read_timeout); a slow "
        "but moving transfer never hits it",
    )
    attempts: int = _bounded(
        StorageSettings.attempts,
        ge=1,
        le=20,
        why=WHY_RETRIES,
        description="tries of one request to the store, the first included (botocore total_max_attempts)",
    )
    progress_every_s: float = _bounded(
        StorageSettings.progress_every_s,
        gt=0,
        le=3600,
        why="a line an hour apart tells nobody the run still waits",
        description="a store call waiting longer than this logs a line naming the object, then again each "
        "time this passes",
    )


class Profile(_Strict):
    profile: str = Field(description="the profile's name (its file stem)")
    run_root: str = Field(description="where every artifact of this profile is written")
    target: TargetConfig = Field(description="the verifier model")
    datasets: list[DatasetConfig] = Field(description="prompt and conversation datasets, one partition each")
    generation: GenerationConfig = Field(description="how raw_responses regenerates assistant turns")
    data: DataConfig = Field(DataConfig(), description="tokenize, merge and vocabulary settings")
    gpu_host: GpuHostConfig = Field(GpuHostConfig(), description="where GPU work runs")
    hidden: HiddenConfig = Field(description="hidden-state extraction and storage")
    storage: StorageConfig = Field(
        StorageConfig(),
        description="timeouts, tries and progress lines of object-store "
        "calls (hidden.root, train.export_location as URLs)",
    )
    drafter: DrafterOverrides = Field(DrafterOverrides(), description="the drafter's shape")
    train: TrainConfig = Field(TrainConfig(), description="drafter training")
    bench: BenchConfig = Field(BenchConfig(), description="benchmark_report")

    @field_validator("run_root")
    @classmethod
    def _local_run_root(cls, value: str) -> str:
        _a_folder(value)  # '' would be the checkout itself (a relative run_root is under it)
        try:  # append-only logs, byte-offset reads, torchrun checkpoints: a file system
            location(value).local_path()
        except ValueError:
            raise ValueError(
                "must be a local folder; hidden.root and train.export_location may be object-store URLs"
            ) from None
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
            t = gen.temperature if isinstance(gen, GenerationConfig) else (gen or {}).get("temperature", 0.0)
            bench["temperatures"] = [0.0] + ([float(t)] if t and float(t) > 0 else [])
            data = {**data, "bench": bench}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> "Profile":
        for path, text in _profile_strings(self, ""):  # every URL field, and any URL in a list or mapping
            if why := url_credentials(text):
                raise ValueError(
                    f"{path}: the URL carries a credential, {why}; the value is not shown. A profile "
                    "is published (run metadata, logs): credentials come from the environment "
                    "(generation.api_key_env names the chat API key's variable; a store's are "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, …)"
                )
        names = [d.name for d in self.datasets]
        seen: dict[str, int] = {}
        for i, name in enumerate(names):  # case-insensitively: A1 and a1 are one file on macOS and Windows
            if name.lower() in seen:
                raise ValueError(
                    f"datasets[{i}].name: {name!r} is already the name of datasets[{seen[name.lower()]}] "
                    f"({names[seen[name.lower()]]!r}); dataset names must be unique, ignoring case"
                )
            seen[name.lower()] = i
        unknown = sorted(set(self.data.drop_datasets) - set(names))
        if unknown:
            raise ValueError(f"data.drop_datasets names datasets that are not configured: {unknown}")
        lk_options = sorted({"lk_kl_scale", "lk_kl_decay"} & self.train.model_fields_set)
        if lk_options and self.train.loss != "lk_lambda":  # accepted and ignored would be a silent no-op
            raise ValueError(
                f"train.{', train.'.join(lk_options)}: set, but only train.loss: lk_lambda uses it and "
                f"train.loss is {self.train.loss!r}; remove it, or set train.loss: lk_lambda"
            )
        options = [o for o in EAGLE31_OPTIONS if getattr(self.drafter, o)]
        if why := served_drafter_problem(
            self.hidden.aux_layers, self.drafter.attention, options, self.gpu_host.sglang_version
        ):
            raise ValueError(why)
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
        why = _bounds_reason(e["loc"]) if e["type"] in _BOUND_ERRORS else None
        lines.append(f"  {loc}: {e['msg']}" + (f" ({why})" if why else ""))
    return "\n".join(lines)


_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _inner_model(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in typing.get_args(annotation) if (m := _inner_model(a)) is not None), None)


def _bounds_reason(loc: tuple) -> str | None:
    """The `why` of the field at an error's location (list indexes and tuple positions skipped)."""
    model: type[BaseModel] | None = Profile
    info = None
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        info = model.model_fields.get(part)
        if info is None:
            return None
        model = _inner_model(info.annotation)
    extra = info.json_schema_extra if info is not None else None
    bounds = extra.get("bounds") if isinstance(extra, dict) else None
    return bounds if isinstance(bounds, str) else None


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
                    raise _DuplicateKey(
                        f"key {key!r} appears twice in one mapping (lines {seen[key]} and "
                        f"{key_node.start_mark.line + 1}); the second would silently replace the "
                        f"first: merge them into one"
                    )
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
