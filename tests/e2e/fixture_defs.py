"""A test-only code location: two fake GPU assets in pool `gpu_host`.

Each asset launches a child through the project's GPU-host resource
(`GpuHostResource.run_pipes`, local transport), exactly as the real GPU assets do, under the project's
executor (`assets._common.EXECUTOR`); the child records its pid and that of its launcher, then
sleeps. The pool test runs both assets at once and checks the pool serialises
them; the crash test SIGKILLs the run's worker processes mid-sleep and checks
that the child dies with them and the pool slot comes back.

Run as a script, this file is that child (it speaks dagster-pipes).
"""

# No `from __future__ import annotations`: Dagster reads the context and config
# annotations of asset functions at definition time and rejects strings.
import json
import os
import sys
import time
from pathlib import Path

GPU_POOL = "gpu_host"


def child_main() -> None:
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        seconds = float(pipes.get_extra("seconds"))
        record = Path(pipes.get_extra("record"))
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "started": time.time()}))
        os.replace(tmp, record)
        pipes.log.info(f"child {os.getpid()} sleeping {seconds} s")
        time.sleep(seconds)
        pipes.report_asset_materialization(metadata={"slept_s": seconds, "child_pid": os.getpid()})


if __name__ == "__main__":
    child_main()
    sys.exit(0)


import dagster as dg  # noqa: E402  (the child above must not pay for importing dagster)

from assets._common import EXECUTOR  # noqa: E402  (after the child's entry point above, as dagster is)
from resources.gpu_host import GpuHostResource, HostEntry  # noqa: E402  (after the child's entry point above, as dagster is)


class SleepConfig(dg.Config):
    seconds: float = 2.0
    record: str = "where the child writes its pid, as JSON"


def _gpu_asset(name: str) -> dg.AssetsDefinition:
    @dg.asset(name=name, pool=GPU_POOL, required_resource_keys={"gpu_host"})
    def _asset(context: dg.AssetExecutionContext, config: SleepConfig) -> dg.MaterializeResult:
        Path(config.record).parent.mkdir(parents=True, exist_ok=True)
        (Path(config.record).with_suffix(".worker")).write_text(
            json.dumps({"step_pid": os.getpid(), "step_ppid": os.getppid()})
        )
        return context.resources.gpu_host.run_pipes(
            context=context,
            command=[sys.executable, str(Path(__file__).resolve())],
            extras={"seconds": config.seconds, "record": config.record},
            name=name,
        ).get_materialize_result()

    return _asset


gpu_a = _gpu_asset("gpu_a")
gpu_b = _gpu_asset("gpu_b")

defs = dg.Definitions(
    assets=[gpu_a, gpu_b],
    jobs=[
        dg.define_asset_job("gpu_a_job", selection=["gpu_a"]),
        dg.define_asset_job("gpu_b_job", selection=["gpu_b"]),
    ],
    executor=EXECUTOR,
    # The project's resource, local transport, this interpreter; pid files go to the test's scratch folder.
    resources={"gpu_host": GpuHostResource(hosts=[HostEntry(python=sys.executable, workdir=dg.EnvVar("E2E_SCRATCH"))])},
)
