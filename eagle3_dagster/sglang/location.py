"""Where the interpreter that runs it finds SGLang, without importing it: run by `sglang.patch` for `eagle3 patch
--python PATH`.

`python -c <this file's source>` prints one JSON line, {"version": the installed sglang's metadata version,
"root": the folder of the sglang package `import sglang` would load}; `importlib.util.find_spec` finds the
package without running it. No SGLang: exit 1, the last line of stderr `ModuleNotFoundError: No module named
sglang`. The file is sent as source (`gpu_host.program_argv`) because the interpreter may have nothing of this
project, so it uses the standard library only, and nothing runs on import.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os


def locate() -> dict:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise SystemExit("ModuleNotFoundError: No module named sglang")
    return {"version": importlib.metadata.version("sglang"), "root": os.path.dirname(spec.origin)}


if __name__ == "__main__":
    print(json.dumps(locate()))
