"""Every path an asset's metadata names is a file or folder that exists: a reader of the asset page opens it.

Reads the session's micro run (tests/micro_run.py: `scripts/run_pipeline.py`, what `scripts/demo.sh` runs).
raw_responses once named `<dataset>.rejected.jsonl` for a dataset read from a package (ShareGPT), where no
source file is read line by line and none is written.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from tests.micro_run import MICRO_ASSETS as ASSETS
from tests.micro_run import MicroRun

pytestmark = [
    pytest.mark.slow,  # the demo pipeline end to end in a subprocess
    pytest.mark.xdist_group("micro_run"),
]  # one worker builds the session's micro run (tests/conftest.py)


def named_paths(metadata: dict) -> dict[str, str]:
    """The entries that name a local path: path values, and text values of keys ending in _path or _dir."""
    found = {}
    for key, value in metadata.items():
        if isinstance(value, dg.PathMetadataValue):
            found[key] = str(value.value)
        elif isinstance(value, dg.TextMetadataValue) and key.endswith(("_path", "_dir")) and "://" not in value.value:
            found[key] = value.value
    return found


def test_every_path_in_the_latest_materializations_metadata_exists(micro_run: MicroRun) -> None:
    missing, seen = {}, 0
    with micro_run.instance() as instance:
        for asset in ASSETS:
            records = instance.fetch_materializations(dg.AssetKey(asset), limit=100).records
            assert records, asset
            partitions = {}
            for record in records:  # the latest materialization of each partition
                partitions.setdefault(record.asset_materialization.partition, record.asset_materialization)
            for partition, materialization in partitions.items():
                for key, path in named_paths(materialization.metadata).items():
                    seen += 1
                    if not Path(path).exists():
                        missing[f"{asset}[{partition}].{key}" if partition else f"{asset}.{key}"] = path
    assert seen >= len(ASSETS)
    assert missing == {}
