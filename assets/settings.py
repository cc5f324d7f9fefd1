"""Which settings each asset's output depends on, and how an edit to them reaches the UI.

Each asset declares here the settings its output depends on (`READS`) and those its stage only runs with
(`RUNS_WITH`: where, how fast, how often); the asset hands its engine stage the profile restricted to those
two (`given`), so a stage that comes to use any other setting fails at once, naming it, instead of drifting
from what its code version hashes.

Dagster marks an asset stale when its own code version changes or when an
input's data version changed since it was materialized; a stale parent does not
make its children stale. An edit to `data.max_seq_len` invalidates everything
below merged_train long before merged_train is rebuilt, so each asset's code
version hashes the settings it reads *and* those of every asset whose content it
consumes: its deps in the built graph (`inputs`), but for a dep marked as a gate (`gate`), whose verdict
it waits for but whose content it does not read. The edit marks every invalidated asset stale at the next
reload, and only those (an edit to `hidden.backfill_cron` invalidates nothing). `versioned` writes the
code versions, and the settings they hash as each asset's definition metadata, once the graph is built.

Every materialization records the settings it was built with; the
`changed_settings` sensor compares them with the loaded profile and reports the
difference as an observation on each invalidated asset, so the asset page names
what changed (`data.max_seq_len: 192 → 256`), not just a new hash.
"""

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from eagle3_dagster.config import Profile, restricted

CODE_VERSION = "2"
SETTINGS_KEY = "settings"
CHANGED_KEY = "changed_settings"
GATE_KEY = "eagle3/gate"

# The settings (dotted paths into the profile) that change an asset's own output.
READS: dict[str, tuple[str, ...]] = {
    "target_model": ("target.kind", "target.path", "target.dtype", "target.tiny"),
    "raw_responses": ("datasets", "generation.backend", "generation.base_url", "generation.model",
                      "generation.max_new_tokens", "generation.temperature", "generation.reasoning",
                      "generation.reasoning_style", "generation.extra_body", "data.max_seq_len",
                      "data.heldout_fraction", "target.dtype"),
    # the answers' producer (generation.backend, model) is recorded in every tokenized record
    "tokenized_dataset": ("datasets", "data.max_seq_len", "data.heldout_fraction", "data.bad_fraction_threshold",
                          "generation.backend", "generation.model"),
    "merged_train": ("datasets", "data.max_seq_len", "data.shuffle_seed", "data.drop_datasets",
                     "hidden.samples_per_shard"),
    "vocab_mapping": ("data.draft_vocab_size",),
    # a plan is its prediction: the hours (throughput) and the training schedule (train.*) it prints
    "extraction_plan": ("hidden.root", "hidden.backend", "hidden.aux_layers", "hidden.dtype", "data.max_seq_len",
                        "hidden.samples_per_shard", "hidden.batch_tokens", "hidden.throughput_tokens_per_s",
                        "train.batch_tokens", "train.epochs", "train.eval_fraction", "train.grad_accum",
                        "train.max_steps", "train.nnodes", "train.nproc_per_node", "train.seed", "train.warmup_ratio"),
    "hidden_states": ("hidden.root", "hidden.backend", "hidden.aux_layers", "hidden.dtype", "data.max_seq_len",
                      "hidden.samples_per_shard", "hidden.batch_tokens", "hidden.tp_size"),
    # the export's aux ids and EAGLE 3.1 options are written for the SGLang release that will serve it
    "drafter_checkpoint": ("train", "drafter", "target.serving_context", "target.dtype", "gpu_host.sglang_version"),
    # the held-out prompts are the data split's; the served drafter runs on the captured layers
    "benchmark_report": ("bench", "data.heldout_fraction", "data.max_seq_len", "hidden.aux_layers",
                         "target.serving_context", "gpu_host.sglang_version"),
}
# The settings a stage is also given that do not change what it writes, and why.
_TARGET_FILES = ("target.kind", "target.path", "target.trust_remote_code", "target.reviewed_code")  # where the
# target's files are, and whether its own code may run, and which (it loads, or the stage fails: it never loads
# something else)
_HOSTS = ("gpu_host",)  # which machines run it, and the SGLang release they must have
RUNS_WITH: dict[str, tuple[str, ...]] = {
    "target_model": (),
    # what regeneration costs and how it is paced: money limits, concurrency, retries, tolerated failures; the
    # share of a source file's lines that may be unusable before anything is sent (a refusal, not content)
    "raw_responses": (*_TARGET_FILES, "generation.api_key_env", "generation.concurrency", "generation.max_retries",
                      "generation.timeout_s", "generation.budget_usd", "generation.price_usd_per_completion_token",
                      "generation.price_usd_per_prompt_token", "generation.max_failure_fraction",
                      "generation.resend_interrupted", "data.bad_fraction_threshold"),
    "tokenized_dataset": _TARGET_FILES,
    "merged_train": (),
    "vocab_mapping": _TARGET_FILES,
    # the hours for the hosts configured now; its table also gives them for 1..N hosts; the draft KV cache of the
    # drafter the profile describes (a figure it reports, not part of the plan)
    "extraction_plan": (*_TARGET_FILES, *_HOSTS, "hidden.staging_dir", "drafter", "target.serving_context",
                        "target.dtype"),
    # the server's port, its extra flags (one that would change a row is refused at launch), parallel requests,
    # where shards are staged, how long a run may take
    "hidden_states": (*_TARGET_FILES, *_HOSTS, "hidden.staging_dir", "hidden.sglang_port", "hidden.sglang_server_args",
                      "hidden.sglang_concurrency", "hidden.max_runtime_s"),
    "drafter_checkpoint": (*_TARGET_FILES, *_HOSTS),
    "benchmark_report": (*_TARGET_FILES, *_HOSTS, "hidden.sglang_port", "hidden.sglang_server_args", "hidden.tp_size"),
}


def gate(asset: str, why: str) -> dg.AssetDep:
    """A dep whose verdict the asset waits for and whose content it does not read (`why` says so)."""
    return dg.AssetDep(asset, metadata={GATE_KEY: why})


def inputs(specs: Iterable[dg.AssetSpec]) -> dict[str, tuple[str, ...]]:
    """The assets whose content each asset reads: its deps in the graph, but for gates."""
    return {spec.key.to_user_string(): tuple(dep.asset_key.to_user_string() for dep in spec.deps
                                              if GATE_KEY not in (dep.metadata or {}))
            for spec in specs}


def given(profile: Profile, asset: str) -> Profile:
    """The profile as the asset's stage gets it: the settings it reads and those it runs with, nothing else."""
    return restricted(profile, (*READS[asset], *RUNS_WITH[asset]), asset)


def setting_paths(asset: str, graph: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The asset's own settings and, transitively, those of every asset whose content it reads."""
    paths: set[str] = set(READS[asset])
    for parent in graph.get(asset, ()):  # an observed source asset has no inputs
        paths.update(setting_paths(parent, graph))
    return sorted(paths)


def settings_for(profile: Profile, asset: str, graph: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    return {path: _value(profile, path) for path in setting_paths(asset, graph)}


def code_version(settings: Mapping[str, Any]) -> str:
    """An asset's code version: bumped by hand when its code changes, plus a hash of its settings."""
    payload = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return f"{CODE_VERSION}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"


def versioned(assets: list, profile: Profile) -> list:
    """The assets with their code versions and the settings these hash (definition metadata `settings`).

    Computed from the built graph: an asset's code version cannot be known before its inputs'.
    """
    graph = inputs(spec for a in assets if isinstance(a, dg.AssetsDefinition) for spec in a.specs)

    def with_settings(spec: dg.AssetSpec) -> dg.AssetSpec:
        settings = settings_for(profile, spec.key.to_user_string(), graph)
        return spec.replace_attributes(code_version=code_version(settings),
                                       metadata={**spec.metadata, SETTINGS_KEY: dg.MetadataValue.json(settings)})

    return [a.map_asset_specs(with_settings) if isinstance(a, dg.AssetsDefinition) else a for a in assets]


def recorded_settings(context: dg.AssetExecutionContext) -> dict[str, dg.MetadataValue]:
    """What a materialization records: the settings its asset's definition was built with."""
    spec = context.assets_def.specs_by_key[context.asset_key]
    return {SETTINGS_KEY: spec.metadata[SETTINGS_KEY]}


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> list[dict[str, str]]:
    """One row per setting whose value differs, as the UI table shows them."""
    rows = []
    for path in sorted(set(recorded) | set(current)):
        before, after = recorded.get(path, "(not set)"), current.get(path, "(not set)")
        if before != after:
            rows.append({"setting": path, "before": _text(before), "after": _text(after)})
    return rows


def _value(profile: Profile, path: str) -> Any:
    value: Any = profile
    for part in path.split("."):
        value = getattr(value, part)
    if isinstance(value, list):
        return [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


CHANGED_SCHEMA = dg.TableSchema(columns=[
    dg.TableColumn("setting", "string", description="dotted path in the profile"),
    dg.TableColumn("before", "string", description="value at the asset's latest materialization"),
    dg.TableColumn("after", "string", description="value in the loaded profile"),
])


def build_sensor(specs: Iterable[dg.AssetSpec]) -> dg.SensorDefinition:
    """`specs`: the built graph's, carrying the settings `versioned` wrote."""
    current = {spec.key.to_user_string(): spec.metadata[SETTINGS_KEY].data for spec in specs
               if SETTINGS_KEY in spec.metadata}

    @dg.sensor(
        name="changed_settings",
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="After a profile edit and a reload, names on each invalidated asset the settings that "
        "differ from those its latest materialization was built with (an observation with a table).",
    )
    def changed_settings_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        reported: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        events = []
        for asset, now in current.items():
            recorded = _recorded_settings(context.instance, asset)
            if recorded is None:
                continue
            rows = changed_settings(recorded, now)
            digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16] if rows else ""
            if rows and reported.get(asset) != digest:
                events.append(dg.AssetObservation(asset_key=asset, metadata={
                    CHANGED_KEY: dg.MetadataValue.table([dg.TableRecord(r) for r in rows], schema=CHANGED_SCHEMA),
                    "changed_setting_names": ", ".join(r["setting"] for r in rows),
                    "num_changed_settings": len(rows),
                }))
            reported[asset] = digest
        return dg.SensorResult(asset_events=events, cursor=json.dumps(reported, sort_keys=True))

    return changed_settings_sensor


def _recorded_settings(instance: dg.DagsterInstance, asset: str) -> dict[str, Any] | None:
    event = instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None or event.asset_materialization is None:
        return None
    value = event.asset_materialization.metadata.get(SETTINGS_KEY)
    data = getattr(value, "data", None)
    return data if isinstance(data, dict) else None

