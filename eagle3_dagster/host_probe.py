"""The preflight probe: run by the GPU host's interpreter, it prints one JSON line describing what a step needs.

`python -c <this file's source> OUTPUT_DIR` (`gpu_host.GpuHost.preflight`): the file is sent, not imported
there, because whether the host can import this project is one of the things it reports. So it uses the
standard library only, and nothing runs on import. Fields: the interpreter and its Python version; the SGLang
release that `import sglang` gives (`sglang.__version__`, else the installed metadata) and the sha256 of its
`srt/models/deepseek_v2.py` (the preflight turns that into the patch state) or why it does not import; the
number of GPUs (`nvidia-smi -L`, else torch where the host has a GPU device node at all); the nearest existing
folder of OUTPUT_DIR and its free bytes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys

# A host without any of these has no GPU a torch build could see (NVIDIA's driver, AMD's ROCm, WSL's GPU bridge).
# Without nvidia-smi the probe asks torch only on a host with one: importing torch is ~2 s of CPU, paid by every
# GPU step's preflight on a CPU host (the demo, the tests).
GPU_DEVICE_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def probe(output_dir: str) -> dict:
    out = {
        "python": sys.executable,
        "python_version": sys.version.split()[0],
        "sglang_version": None,
        "sglang_error": None,
        "deepseek_v2_sha256": None,
        "gpu_count": 0,
        "gpu_error": None,
        "eagle3_dagster": importlib.util.find_spec("eagle3_dagster") is not None,
    }
    try:  # the release that is imported: sglang.__version__ (sglang/version.py), else the installed metadata
        import sglang
        from importlib.metadata import version

        out["sglang_version"] = getattr(sglang, "__version__", None) or version("sglang")
        f = os.path.join(os.path.dirname(sglang.__file__), "srt", "models", "deepseek_v2.py")
        if os.path.exists(f):
            with open(f, "rb") as fh:
                out["deepseek_v2_sha256"] = hashlib.sha256(fh.read()).hexdigest()
    except Exception as e:
        out["sglang_error"] = f"{type(e).__name__}: {e}"
    try:  # nvidia-smi answers in a second; importing torch takes several
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        out["gpu_count"] = sum(1 for line in smi.stdout.splitlines() if line.startswith("GPU "))
    except Exception as e:
        devices = [p for p in GPU_DEVICE_PATHS if os.path.exists(p)]
        if not devices:
            out["gpu_error"] = f"no nvidia-smi ({e}) and no GPU device (none of {', '.join(GPU_DEVICE_PATHS)})"
        else:
            try:
                import torch

                out["gpu_count"] = torch.cuda.device_count()
            except Exception as e2:
                out["gpu_error"] = f"no nvidia-smi ({e}) and no torch ({e2})"
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    out["disk_path"] = path
    out["free_bytes"] = shutil.disk_usage(path).free
    return out


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
