"""What each metadata key an asset emits measures, and on what data: the `metadata_legend` entry.

Dagster 1.13 has no per-key description for materialization metadata (`MetadataEntry`, which had
one, is unusable since 1.x; table columns are the only values with descriptions, see
`_common.table`). So every materialization carries one markdown entry, `metadata_legend`, listing
its keys with their descriptions. The engine's keys stay as the engine emits them; this module
only describes them. A key with no description is listed as such, so the legend never hides one
(tests/assets/test_hidden_gates.py asserts the hidden-state assets have none).
"""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

LEGEND_KEY = "metadata_legend"
UNDESCRIBED = "(not described yet)"

# Keys that mean the same on every asset that emits them.
COMMON: dict[str, str] = {
    "settings": "the profile settings this asset was built with (a change shows in the settings sensor)",
    "run_tags": "the run tags every run of this asset gets, however it is launched",
}

BY_ASSET: dict[str, dict[str, str]] = {
    "raw_responses": {
        "path": "the append-only response log (JSONL) of this dataset",
        "dataset": "the dataset (partition) regenerated",
        "source": "what reading the prompts found: conversations kept, skipped as too long for data.max_seq_len, "
        "turns cut, and the reader's own counts",
        "regenerated": "false for a dataset whose answers are not regenerated: the file is registered as it is",
        "sha256": "sha256 of the registered file (its data version)",
        "bytes": "size of the registered file",
        "num_source_lines_quarantined": "lines of the source file that could not be used (source_quarantine_path)",
        "source_quarantine_path": "the unusable source lines, each with its reason",
        "num_conversations_quarantined_chat_template": "conversations the target's chat template failed to render",
        "chat_template_quarantine_path": "those conversations, each with the template's error",
        "num_conversations": "conversations this run went through (new and already complete)",
        "num_conversations_complete": "conversations with every assistant turn on record at the end of the run",
        "num_conversations_already_complete": "conversations complete before this run (nothing sent)",
        "num_conversations_interrupted": "conversations left incomplete by a stop (budget, failures): resumed next run",
        "num_conversations_failed": "conversations with a request that failed for good",
        "num_turns": "assistant turns this run answered or reused (on record already) for the conversations not "
        "complete before it; a conversation complete before the run is skipped, its turns not counted",
        "num_requests": "chat requests sent in this run",
        "num_successes": "requests answered and recorded in this run",
        "num_turns_reused": "turns already on record (same request id), not sent again",
        "num_turns_skipped": "assistant turns with no user turn before them (nothing to answer)",
        "num_tries_maybe_paid": "tries that timed out after reaching the provider: booked at their cost bound",
        "num_failed_maybe_paid": "requests whose last try was such a timeout: held back by the next run",
        "num_requests_held_back_maybe_paid": "requests not re-sent because they may be paid already "
        "(generation.resend_interrupted)",
        "unsettled_usd_at_start": "cost bounds of tries an earlier run left in flight, booked as spent",
        "num_turns_set_aside": "turns on record from another producer (target, model or tokenizer): not used",
        "set_aside_by_reason": "num_turns_set_aside by reason",
        "failures_by_kind": "requests that failed for good, by kind of error",
        "attempt_failures_by_kind": "every failed try, retried or not, by kind of error",
        "prompt_tokens": "prompt tokens the provider reported for this run's requests",
        "completion_tokens": "completion tokens the provider reported for this run's requests",
        "reasoning_tokens": "reasoning tokens among the completion tokens",
        "cost_usd": "USD spent by this run",
        "recorded_cost_usd": "USD spent on this dataset by every run so far",
        "num_paid_unusable": "answers paid for (HTTP 200) that could not be used",
        "num_replies_usage_malformed": "paid answers whose usage.cost or token counts were not amounts (negative, "
        "NaN, infinite, not a number): each booked at its cost bound",
        "stopped_by_budget": "whether generation.budget_usd stopped the run",
        "repaired_bytes": "bytes of a torn last line cut from the log before appending",
        "wall_s": "seconds the run took",
        "requests_per_s": "num_requests / wall_s",
    },
    "tokenized_dataset": {
        "path": "tokenized_data.jsonl: input_ids and loss_mask per record",
        "quarantine_path": "quarantine.jsonl: each input that could not be tokenized, with its reason",
        "dataset": "the dataset (partition) tokenized",
        "source": "what reading the prompts found (datasets tokenized as they are, not regenerated)",
        "num_inputs": "inputs read: recorded turns, conversations' assistant turns, or pre-tokenized lines",
        "num_records": "records written",
        "num_tokens": "tokens in the records",
        "num_loss_tokens": "supervised tokens (loss_mask 1): the target's own answer tokens",
        "num_dropped_length": "answers cut off by max_new_tokens (finish_reason length): dropped",
        "num_quarantined": "inputs quarantined (quarantine_path)",
        "quarantine_by_reason": "num_quarantined by reason",
        "num_usage_checked": "answers whose rebuilt completion length was compared with the provider's "
        "usage.completion_tokens",
        "num_usage_mismatch": "of those, the ones whose lengths differ beyond the tolerance",
        "usage_mismatch_rate": "num_usage_mismatch / num_usage_checked",
        "num_exact_completion_ids": "answers whose token ids came from the backend, not re-tokenized",
        "num_set_aside": "turns of another producer (target, served model or tokenizer): not tokenized",
        "set_aside_by_reason": "num_set_aside by reason",
        "bad_fraction": "num_quarantined / num_inputs (the stage fails above data.bad_fraction_threshold)",
    },
    "merged_train": {
        "path": "merged_train.jsonl: every kept record, truncated and shuffled",
        "sha256": "sha256 of merged_train.jsonl (its data version; the extraction plan names it)",
        "num_shards": "hidden-state shards this file makes at hidden.samples_per_shard: the partitions of "
        "hidden_states",
        "num_records": "records in merged_train",
        "num_tokens": "tokens in merged_train",
        "num_loss_tokens": "supervised tokens in merged_train",
        "loss_token_share": "num_loss_tokens / num_tokens",
        "num_truncated": "records cut to data.max_seq_len (loss masks recomputed)",
        "num_dropped_by_truncation": "records dropped because every supervised token was beyond data.max_seq_len",
        "dropped_datasets": "data.drop_datasets: datasets left out",
        "before": "records, tokens and supervised tokens per dataset before the drop list and truncation",
        "after": "the same per dataset in merged_train",
        "token_share": "each dataset's share of merged_train's tokens",
        "length_summary": "tokens per record: min, p50, p90, p99, max",
        "records_by_length": "records per length bin (48 bins up to data.max_seq_len), as a sparkline",
        "sequence_lengths": "histogram of tokens per record (sequence_lengths.png)",
    },
    "benchmark_report": {
        "results_json": "every result row (sets × methods × configurations × temperatures) as written",
        "report": "the benchmark report: grids per prompt set, bands, caveats",
        "headline_config": "which row the headline figures are: the trained drafter at the first configuration on "
        "the first set, in its training band",
        "spec": "the headline's num_steps,topk,num_draft_tokens",
        "set": "the headline's prompt set (held-out prompts, never trained on)",
        "acceptance_length": "tokens per verify step, bonus included, of the headline row in its training band",
        "acceptance_length_all_prompts": "the same over all prompts of the set",
        "untrained_acceptance_length": "acceptance length of the untrained drafter (the control) at the headline's "
        "configuration, set and band",
        "ngram_acceptance_length": "acceptance length of n-gram speculation (no drafter) at the headline's "
        "configuration, set and band",
        "headline_band": "the prompt-length band of the headline's acceptance length",
        "speedup": "median over timing rounds of (tokens/s ÷ no_spec's tokens/s in the same round), all prompts",
        "speedup_min": "the lowest timing round's speed-up (same round's no_spec), all prompts",
        "speedup_max": "the highest timing round's speed-up, all prompts",
        "speedup_of_medians": "median tokens/s ÷ no_spec's median tokens/s (the grid's two tokens/s cells), all "
        "prompts; differs from speedup when rounds vary in load",
        "results": "the result rows as a table (column descriptions in its schema)",
    },
    "vocab_mapping": {
        "path": "the d2t/t2d safetensors the drafter trains and serves with",
        "target_vocab_size": "ids in the target's vocabulary",
        "draft_vocab_size": "ids in the draft vocabulary as built (the target's when that is not larger)",
        "requested_draft_vocab_size": "data.draft_vocab_size",
        "draft_vocab_covers_target": "true when the target's vocabulary is not larger than the requested size",
        "note": "why the draft vocabulary is the whole target vocabulary, when it is",
        "num_loss_tokens": "supervised (loss-masked) tokens of merged_train counted",
        "num_distinct_loss_tokens": "distinct ids among them",
        "loss_token_coverage": "share of the supervised tokens whose id is in the draft vocabulary",
        "coverage_by_size": "share of the supervised tokens the n most frequent ids cover, n = 1,024, 2,048, ... "
        "up to the target's vocabulary: read it on the real corpus to choose "
        "data.draft_vocab_size (lm_head cost grows with n)",
    },
    "target_model": {
        "path": "the target's folder (tokenizer, chat template, weights)",
        "num_parameters": "parameters of the tiny target",
        "tokens_seen": "tokens of pre-training the tiny target saw",
        "final_loss": "mean pre-training loss of the tiny target's last 20 steps (of the last tenth of its steps when "
        "it ran fewer than 200), on its training batches",
        "build_seconds": "seconds the build took (tokenizer, pre-training, verified save)",
        "tokenizer_vocab_size": "tokens in the target's tokenizer",
        "identity": "the target's identity: a hash of its config, weights and code files (its data version)",
        "code_files": "the target folder's Python files (what trust_remote_code runs): name → sha256",
        "loss_curve": "the pre-training loss curve (loss_curve.png)",
        "loss_by_step": "pre-training loss on its training batches over the steps (means of windows of steps), as a "
        "sparkline",
    },
    "extraction_plan": {
        "version": "hidden-state version: a hash of everything that changes the shard bytes (target, merged_train, "
        "layers, dtype, backend, shard size)",
        "version_dir": "the folder (or store URL) this version's shards and manifests go to",
        "num_shards": "shards in the plan: the partitions of hidden_states",
        "num_samples": "samples of merged_train the plan covers (all shards)",
        "num_tokens": "tokens of merged_train the plan covers (all shards)",
        "total_bytes": "exact bytes of every shard and its manifest, predicted from the shard format",
        "total_human": "total_bytes in binary units",
        "remaining_bytes": "bytes of the shards not yet complete in their manifest",
        "num_hosts": "GPU hosts in the profile (gpu_host.hosts)",
        "estimated_hours": "hours to extract the remaining shards on num_hosts hosts at hidden.throughput_tokens_per_s",
        "hours_by_hosts": "estimated hours by number of hosts",
        "free_bytes": "free bytes read on the leased host at free_at when the plan was made",
        "free_human": "free_bytes in binary units",
        "free_at": "where free space was measured: hidden.root, or the staging folder for a store",
        "needed_bytes": "bytes that must fit in free_bytes: remaining_bytes, or for a store the largest shard in flight",
        "fits": "needed_bytes <= free_bytes (the fits_on_disk check)",
        "superseded_versions": "other hidden-state versions under hidden.root with their size (job "
        "cleanup_hidden_states deletes them)",
        "superseded_bytes": "bytes the superseded versions take",
        "aux_layers_canonical": "the target layers whose input is captured, in canonical numbering",
        "merged_train_sha256": "sha256 of the merged_train file the plan was made for",
        "plan_path": "the plan file the shard runs read (never recomputed by them)",
        "train_schedule": "what training makes of these shards: optimizer steps and tokens per step",
        "draft_attention": "the drafter's attention (drafter.attention): gqa or mla",
        "draft_kv_dtype": "dtype of the drafter's served KV cache (the export's)",
        "draft_kv_values_per_token": "values the drafter's KV cache holds per token: 2 x num_key_value_heads x "
        "head_dim (GQA), kv_lora_rank + qk_rope_head_dim (MLA)",
        "draft_kv_bytes_per_token": "bytes of the drafter's KV cache per token, served",
        "draft_kv_bytes_at_serving_context": "bytes of the drafter's KV cache for one sequence of "
        "target.serving_context tokens",
        "draft_kv_at_serving_context_human": "draft_kv_bytes_at_serving_context, readable",
    },
    "hidden_states": {
        "version": "hidden-state version this run wrote (as in extraction_plan)",
        "version_dir": "the folder (or store URL) the shards were written to",
        "shards": "the shard keys (partitions) of this run",
        "num_samples": "samples in this run's shards",
        "num_tokens": "tokens in this run's shards",
        "bytes_written": "bytes of this run's shards and their manifests, read back from storage",
        "resumed_shards": "shards found complete in their manifest (size and sha256 checked) and skipped",
        "reextracted_corrupt_shards": "shards whose manifest existed but whose bytes failed it, extracted again",
        "uploaded_from_staging_shards": "shards found complete in the staging folder and only uploaded to the store",
        "forced": "whether the run config set force: complete shards extracted again and replaced",
        "sglang_log": "the SGLang server's log file on the host (sglang backend)",
        "backend": "hidden.backend that computed the states (hf or sglang)",
        "gpu_host": "the GPU host this run leased",
        "shard_sha256": "each shard's sha256 from its manifest (a single shard's is the data version)",
    },
    "drafter_checkpoint": {
        "run_dir": "the training run's folder (checkpoints, metrics.json, curves.png)",
        "export_dir": "the exported drafter (config.json + model.safetensors) SGLang and vLLM load",
        "refused_export_dir": "the export that failed export_matches_sglang (see the check's detail): kept for "
        "inspection, never benchmarked or published",
        "export_location": "where the export was published (train.export_location)",
        "steps": "optimizer steps trained",
        "tokens_per_s": "training throughput: tokens trained per second of this run's training loop, all ranks "
        "together (steps resumed from a checkpoint not counted)",
        "eval_scope": "what the final figures were measured on: heldout (samples never trained on) or "
        "train_batches (training batches, which flatter the drafter)",
        "heldout_loss": "final evaluation loss (forward KL to the target) on held-out samples never trained on",
        "heldout_sim_accept_length": "simulated acceptance length (tokens per verify step) on held-out samples",
        "heldout_samples": "held-out samples the final evaluation scored",
        "heldout_scored_tokens": "supervised tokens of the held-out samples that were scored",
        "train_batches_loss": "final loss on training batches (no held-out samples: it flatters the drafter)",
        "train_batches_sim_accept_length": "simulated acceptance length on training batches (flatters the drafter)",
        "untrained_acc_0": "acc_0 of the untrained drafter on the same samples, before the first step",
        "last_step_train_loss": "loss of the last optimizer step's own training batch (the end of the loss curve), "
        "not an evaluation",
        "loss_by_step": "training loss by optimizer step (the training batches), as a sparkline",
        "acc_0_by_step": "acc_0 by optimizer step on the training batches, as a sparkline",
        "curves": "loss and per-step accuracy curves (curves.png)",
        "target_identity": "identity of the target model the hidden states came from",
        "merged_train_sha256": "sha256 of the merged_train the hidden states were extracted from",
        "hidden_version": "the hidden-state version trained on",
        "num_shards": "hidden-state shards trained on",
        "shards": "each shard trained on with its sha256 (its data version), samples and bytes",
        "git_sha": "git commit of this project that trained",
        "code_version": "the asset's code version (a hash of the settings it reads)",
        "packages": "versions of the packages that trained",
    },
}

# Keys numbered by draft position j (0 = the first drafted token).
PATTERNS: dict[str, list[tuple[str, str]]] = {
    "benchmark_report": [
        (
            r"acceptance_length_t([\d.]+)",
            "acceptance length of the headline configuration sampled at temperature {0}, in the same band",
        ),
        (r"drafter_(\w+)", "the benchmarked drafter's {0} (from results.json meta)"),
    ],
    "drafter_checkpoint": [
        (
            r"heldout_acc_(\d+)",
            "argmax agreement with the target at draft position {0} on held-out samples never trained on",
        ),
        (
            r"train_batches_acc_(\d+)",
            "argmax agreement with the target at draft position {0} on training batches (flatters the drafter)",
        ),
    ],
}


def describe(asset: str, key: str) -> str | None:
    import re

    found = BY_ASSET.get(asset, {}).get(key) or COMMON.get(key)
    if found:
        return found
    for pattern, text in PATTERNS.get(asset, []):
        m = re.fullmatch(pattern, key)
        if m:
            return text.format(*m.groups())
    return None


def undescribed(asset: str, keys: Iterable[str]) -> list[str]:
    return [k for k in keys if k != LEGEND_KEY and describe(asset, k) is None]


def legend(asset: str, keys: Iterable[str]) -> dg.MetadataValue:
    """A markdown table of `keys` (in their order) with what each measures."""
    return markdown_legend((k, describe(asset, k) or UNDESCRIBED) for k in keys if k != LEGEND_KEY)


def markdown_legend(described: Iterable[tuple[str, str]]) -> dg.MetadataValue:
    """A markdown table of (key, what it measures) pairs: the legend of a materialization or a check's verdict."""
    lines = ["| key | what it measures |", "|---|---|"]
    lines += [f"| `{k}` | {text.replace('|', '/')} |" for k, text in described]
    return dg.MetadataValue.md("\n".join(lines))
