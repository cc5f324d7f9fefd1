"""How an asset reads what its upstream made: the upstream's latest materialization, handed over as an input.

Every asset here returns a `MaterializeResult` and writes its own files; what a downstream stage needs of it
(the plan's path, the export's folder, a data version) is in that materialization's metadata. An asset takes
the upstream as a parameter with `AssetIn(key, input_manager_key=UPSTREAM)` (an op: `upstream_in(key)`),
so the data flow is Dagster's lineage (the graph, the run's inputs), and this input manager is the one place
that reads the instance for it. Which metadata entry a downstream reads is the downstream's business
(`Materialized.path("plan_path")`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dagster as dg

UPSTREAM = "upstream"  # the resource key assets name as input_manager_key
_ASSET = "eagle3/upstream_asset"


def upstream_in(asset: str) -> dg.In:
    """An op's input loading `asset`'s latest materialization (Dagster hands a root input manager no asset key)."""
    return dg.In(input_manager_key=UPSTREAM, metadata={_ASSET: asset})


@dataclass(frozen=True)
class Materialized:
    """An upstream asset's latest materialization: its data version and metadata (plain values)."""

    asset: str
    data_version: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def exists(self) -> bool:
        return bool(self.metadata) or self.data_version is not None

    def path(self, key: str) -> str | None:
        """The metadata entry `key` as a path string (a path or text entry), or None when it is absent."""
        value = self.metadata.get(key)
        return None if value is None else str(value)


def latest_materialization(instance: dg.DagsterInstance, asset: dg.AssetKey) -> Materialized:
    """The asset's latest materialization (an empty `Materialized` when it has none)."""
    event = instance.get_latest_materialization_event(asset)
    record = event.asset_materialization if event is not None else None
    if record is None:
        return Materialized(asset.to_user_string())
    metadata = {k: _plain(v) for k, v in record.metadata.items()}
    return Materialized(asset.to_user_string(), (record.tags or {}).get("dagster/data_version"), metadata)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, dg.MetadataValue) else value


class UpstreamMaterializations(dg.ConfigurableIOManager):
    """Loads an asset input as the upstream's latest `Materialized`; stores nothing (assets here write their
    own files and return a `MaterializeResult`, which never reaches an IO manager)."""

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        if obj is not None:
            raise TypeError(f"{context.asset_key.to_user_string()}: the upstream input manager stores nothing")

    def load_input(self, context: dg.InputContext) -> Materialized:
        asset = context.asset_key if context.has_asset_key else dg.AssetKey(context.definition_metadata[_ASSET])
        return latest_materialization(context.instance, asset)
