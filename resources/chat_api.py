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
        """The key, stripped and checked; an error that never shows it when it holds control characters."""
        from eagle3_dagster.generate.client import clean_api_key

        return clean_api_key(self.api_key, "chat_api.api_key (generation.api_key_env)")
