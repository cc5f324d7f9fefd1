"""Billed vs recorded against a provider slower than `generation.timeout_s`: the figures a fix of the budget was measured by.

    PYTHONPATH=tests/unit .venv/bin/python tests/slow_provider_figures.py

Runs the stub provider of `test_slow_provider.py` (loopback HTTP, bills every request it finishes) through
`regenerate_dataset_sync` with whatever `eagle3_dagster` is importable, so the same command measures the code
before and after a change (put the old tree first on PYTHONPATH).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from eagle3_dagster.generate import RegenerationFailedError
from eagle3_dagster.generate.regenerate import regenerate_dataset_sync
from test_slow_provider import TIMEOUT_S, BillingProvider, _backend, _convs, _recorded, _settings


def _run(provider: BillingProvider, store: Path, n: int, **settings) -> None:
    try:
        settings.setdefault("max_failure_fraction", 1.0)
        regenerate_dataset_sync(_convs(n), store, _backend(provider), _settings(**settings), dataset="ds")
    except RegenerationFailedError:
        pass
    provider.settle()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "cap.jsonl"
        with BillingProvider(delay_s=TIMEOUT_S * 3) as provider:
            _run(provider, store, 12)
            print(
                f"cap $0.10, 12 prompts, every request slower than the timeout, max_retries 3: "
                f"billed ${provider.billed_usd:.2f} ({provider.num_billed} sends), recorded ${_recorded(store):.2f}"
            )
            _run(provider, store, 12)
            print(
                f"  after one rerun: billed ${provider.billed_usd:.2f} ({provider.num_billed} sends), "
                f"recorded ${_recorded(store):.2f}"
            )
        store = Path(tmp) / "retry.jsonl"
        with BillingProvider(delay_s=TIMEOUT_S * 3, slow_first=4) as provider:
            _run(provider, store, 4, budget_usd=1.0)
            print(
                f"4 prompts, each times out once then succeeds: billed ${provider.billed_usd:.2f} "
                f"({provider.num_billed} sends), recorded ${_recorded(store):.2f}"
            )


if __name__ == "__main__":
    main()
