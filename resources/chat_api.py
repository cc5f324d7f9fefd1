"""The chat API the regeneration stage talks to: OpenRouter, or an SGLang/vLLM server.

The key arrives through `dg.EnvVar`, so Dagster shows the variable's name in the
launchpad and never its value; it is handed to the engine client, which keeps it
out of logs, metadata, records and exception texts.
"""

from __future__ import annotations

import dagster as dg
from pydantic import Field


class ChatApiResource(dg.ConfigurableResource):
    api_key: str | None = Field(default=None, description="API key; set from an environment variable via EnvVar")

    def key(self) -> str | None:
        return self.api_key or None
