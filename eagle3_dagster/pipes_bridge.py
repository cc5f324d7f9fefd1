"""The one place the engine reports to Dagster: through `dagster-pipes`, never `dagster` itself.

`dagster-pipes` is the zero-dependency child-side library DESIGN §2 prescribes
for processes Dagster launches (torchrun workers, the SGLang extraction
driver): logs, progress and materializations stream into the run. Outside a
Pipes launch, or where the library is not installed (a bare GPU host), the
session is None and the same entry points run by hand with their own progress
bars.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def pipes_session(enabled: bool = True) -> Iterator[Any | None]:
    """The Pipes context when this process was launched through Pipes (and `enabled`), else None."""
    if not enabled:
        yield None
        return
    try:
        from dagster_pipes import is_dagster_pipes_process, open_dagster_pipes
    except ImportError:
        yield None
        return
    if not is_dagster_pipes_process():
        yield None
        return
    with open_dagster_pipes() as pipes:
        yield pipes
