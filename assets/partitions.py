"""Partition definitions shared by assets, jobs, schedules and sensors."""

import dagster as dg

from eagle3_dagster.config import Profile

# One partition per hidden-state shard, registered by the sensor when merged_train
# materializes. Shard size is configuration, so counts stay in the hundreds.
HIDDEN_STATE_SHARDS = dg.DynamicPartitionsDefinition(name="hidden_state_shards")


def dataset_partitions(profile: Profile) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition(profile.dataset_names)
