"""The profile this code location runs, as the resource every asset reads it from.

`definitions.py` loads the profile once (EAGLE3_PROFILE, or the one a test builds) and hands it to the assets
as this resource; an asset reads `profile.get()` and gives its stage the settings it uses
(`eagle3_dagster.stages`). What depends on the profile at definition time (the dataset partitions, code
versions, the shard automation) is applied to the module-level assets by `definitions.build_definitions`.
"""

from __future__ import annotations

from functools import lru_cache

import dagster as dg
from pydantic import Field

from eagle3_dagster.config import Profile


class ProfileResource(dg.ConfigurableResource):
    """The validated profile (configs/<name>.yaml and any overrides), carried as its JSON."""

    profile_json: str = Field(description="the loaded profile, validated, as JSON (configs/<name>.yaml)")

    @classmethod
    def of(cls, profile: Profile) -> "ProfileResource":
        return cls(profile_json=profile.model_dump_json(exclude_unset=True))  # as written: a default is not "set"

    def get(self) -> Profile:
        return _parsed(self.profile_json)


@lru_cache(maxsize=8)
def _parsed(profile_json: str) -> Profile:
    return Profile.model_validate_json(profile_json)
