"""The real-SGLang tier's venv stamp (tests/sglang_cpu/venv.py) depends on the project's environment only."""

from __future__ import annotations

import sys

from tests.sglang_cpu import venv


def test_base_packages_ignore_distributions_elsewhere_on_sys_path(tmp_path, monkeypatch):
    # `python -m tests.sglang_cpu.venv` from the checkout puts the checkout on sys.path, and with it the
    # `eagle3_dagster.egg-info` an editable install leaves there; pytest does not. The digest differed and
    # the venv was rebuilt (minutes) every time the tier ran after a build from the command line.
    before = venv.base_packages()
    probe = tmp_path / "eagle3_probe-1.0.dist-info"
    probe.mkdir()
    (probe / "METADATA").write_text("Metadata-Version: 2.1\nName: eagle3-probe\nVersion: 1.0\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert venv.base_packages() == before


def test_cuda_sync_site_makes_cuda_synchronize_a_no_op_on_a_cpu_torch_and_only_where_asked(tmp_path):
    """`server_env(cuda_sync=True)` puts cuda_sync/sitecustomize.py on a server's path: Python imports it at start-up
    and `torch.cuda.synchronize()` (which SGLang 0.5.23's MLA drafter class calls when it takes the target's
    embeddings) returns instead of raising on this CPU torch; the tier's other servers keep torch's own."""
    import os
    import subprocess

    import torch

    python = (
        tmp_path / "venv" / "bin" / "python"
    )  # server_env reads the release's model modules through this interpreter's venv
    site = venv.site_packages(python) / "sglang" / "srt" / "models"
    site.mkdir(parents=True)
    for name in (*venv.MODEL_MODULES, "other_model"):
        (site / f"{name}.py").write_text("")
    plain, synced = venv.server_env(python), venv.server_env(python, cuda_sync=True)
    assert "PYTHONPATH" not in plain and plain["SGLANG_DISABLED_MODEL_ARCHS"] == "other_model"
    assert synced == plain | {"PYTHONPATH": str(venv.HERE / "cuda_sync")}
    if torch.cuda.is_available():
        return
    code = "import torch; torch.cuda.synchronize(); print(torch.cuda.synchronize.__module__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env | {"PYTHONPATH": synced["PYTHONPATH"]},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "sitecustomize", done.stderr
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "Torch not compiled with CUDA enabled" in done.stderr
