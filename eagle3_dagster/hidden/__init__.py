"""Hidden states of the target for every merged_train sample: shards, the hf backend, the extraction plan.

`sharding` decides which samples go in which shard and names the version;
`shards` owns the file format, writer and manifests (torch-free to import), `dataset`
the training-time reader;
`extract_hf` is the transformers backend; `plan` predicts bytes and time and
cleans up superseded versions; `export_formats` writes SpecForge / speculators
layouts. The SGLang backend lives in its own package and reuses `ShardWriter`.
"""
