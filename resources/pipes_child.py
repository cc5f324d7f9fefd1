"""The child side of Dagster Pipes for the torchrun workers the GPU-host resource launches.

`python -m torch.distributed.run ... -m resources.pipes_child --config job.json`
runs the engine's training worker with a reporter that streams rank 0's
per-step lines into the run log and reports the final metrics as the
materialization. It needs only `dagster-pipes` (zero dependencies; the `[gpu]`
extra), so it also runs in SGLang's interpreter on a GPU host. Launched by
hand, or on ranks other than 0, it is the plain engine worker.
"""

from __future__ import annotations

import os
import sys

from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, PipesContext, open_dagster_pipes

from eagle3_dagster.train.worker import main as train_main


class PipesReporter:
    def __init__(self, pipes: PipesContext) -> None:
        self.pipes = pipes

    def log(self, line: str) -> None:
        self.pipes.log.info(line)

    def report(self, metadata: dict) -> None:
        self.pipes.report_asset_materialization(metadata=metadata)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("RANK", "0") != "0" or DAGSTER_PIPES_CONTEXT_ENV_VAR not in os.environ:
        train_main(argv)
        return
    with open_dagster_pipes() as pipes:
        train_main(argv, reporter=PipesReporter(pipes))


if __name__ == "__main__":
    main()
