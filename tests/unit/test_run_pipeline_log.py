"""What scripts/run_pipeline.py prints of a run's log: its messages, and each error with its causes, whether a
step failed or the run itself (a run worker that could not load the code location fails no step)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import run_pipeline  # noqa: E402  (scripts/ is put on sys.path above)


def test_messages_and_errors_with_their_causes_are_printed_once() -> None:
    pad = run_pipeline.Launchpad("http://127.0.0.1:1")
    pages = [
        {
            "logsForRun": {
                "__typename": "EventConnection",
                "cursor": "2",
                "events": [
                    {"__typename": "LogMessageEvent", "message": "pretrain: 1/2 steps", "level": "INFO"},
                    {"__typename": "LogMessageEvent", "message": "a debug line", "level": "DEBUG"},
                    {"__typename": "ExecutionStepStartEvent", "message": "Started execution of step", "level": "DEBUG"},
                    {
                        "__typename": "ExecutionStepFailureEvent",
                        "message": "Execution of step failed.",
                        "level": "ERROR",
                        "error": {
                            "message": "Error occurred while executing op\n",
                            "causes": [{"message": "ValueError: bad"}],
                        },
                    },
                    {
                        "__typename": "RunFailureEvent",
                        "message": "Execution of run failed.",
                        "level": "ERROR",
                        "error": {"message": "ImportError: cannot import name x", "causes": []},
                    },
                ],
            }
        },
        {"logsForRun": {"__typename": "EventConnection", "cursor": "2", "events": []}},
    ]
    asked: list = []
    pad.query = lambda text, variables=None: asked.append(variables) or pages[len(asked) - 1]
    assert pad.new_log_lines("r1") == [
        "pretrain: 1/2 steps",
        "Execution of step failed.",
        "Error occurred while executing op",
        "ValueError: bad",
        "Execution of run failed.",
        "ImportError: cannot import name x",
    ]
    assert pad.new_log_lines("r1") == [] and asked[1] == {"runId": "r1", "after": "2"}
