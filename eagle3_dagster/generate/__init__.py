"""raw_responses: regenerate assistant turns with the target (HTTP API or in-process), resumably.

`regenerate.py` walks conversations and owns request ids, budget and stats;
`client.py` is the backend interface and its OpenAI-compatible implementation;
`local_backend.py` runs the target with transformers; `store.py` is the
append-only log a killed run resumes from.
"""

from eagle3_dagster.generate.client import ChatBackend, ChatRequestError, ChatResult, OpenAIChatBackend
from eagle3_dagster.generate.regenerate import (
    GenerationSettings,
    RegenerationFailedError,
    RegenerationStats,
    regenerate_dataset,
    regenerate_dataset_sync,
    request_id,
)
from eagle3_dagster.generate.store import ResponseStore, StoreLockedError, iter_turns

__all__ = [
    "ChatBackend",
    "ChatRequestError",
    "ChatResult",
    "GenerationSettings",
    "OpenAIChatBackend",
    "RegenerationFailedError",
    "RegenerationStats",
    "ResponseStore",
    "StoreLockedError",
    "iter_turns",
    "regenerate_dataset",
    "regenerate_dataset_sync",
    "request_id",
]
