"""Health checks of an SGLang server, run by the GPU host's interpreter beside it (`sglang.server`).

`python -c <this file's source> port PORT`: exit 0 when something accepts TCP connections on
127.0.0.1:PORT, else 1 (before a launch: is the port taken?).

`python -c <this file's source> wait URL TIMEOUT_S NAME`: poll `/health_generate` until 200 (503 while
SGLang loads), then check that the server answering is the one launched with `--served-model-name NAME`.
`/model_info` has the field `served_model_name` from 0.5.18 on; `/v1/models` lists it as `data[].id` in
every release 0.5.10-0.5.23. Exit 0: ours and healthy; 1: not healthy in time (the last error printed);
2: another server answers on the port (its names printed).
The benchmark client (`bench.served`) imports `served_names` for the same check.

The file is sent as source rather than run with `-m`, so the host runs the worker's own version of it
whatever copy of this project it has installed; it uses the standard library only, and nothing runs on import.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request


def port_answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read() or b"null")


def served_names(url: str) -> list[str]:
    """The names the server at `url` answers under: /model_info `served_model_name` (0.5.18+), else the /v1/models
    ids (the benchmark client asks too, `bench.served`). A /model_info that fails or lacks the field is passed over;
    a /v1/models that fails raises (urllib.error.HTTPError; ValueError or AttributeError when it is not a model list)."""
    try:
        info = _get(url + "/model_info")
        if isinstance(info, dict) and "served_model_name" in info:
            return [info["served_model_name"]]
    except (urllib.error.HTTPError, ValueError):
        pass
    models = _get(url + "/v1/models")
    return [m.get("id") for m in models.get("data", [])]


def wait_healthy(url: str, timeout_s: float, name: str) -> int:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health_generate", timeout=30) as r:
                healthy = r.status == 200
        except urllib.error.HTTPError as e:
            healthy, last = False, f"HTTP {e.code}"
        except Exception as e:
            healthy, last = False, repr(e)
        if healthy:
            try:
                names = served_names(url)
            except (urllib.error.HTTPError, ValueError, AttributeError) as e:
                names = [f"<no model list: {e!r}>"]
            if name in names:
                return 0
            print(f"the server answering at {url} serves {names}, not {name!r}, the name this run launched it with")
            return 2
        time.sleep(1)
    print(last)
    return 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["port"]:
        return 0 if port_answers(int(argv[1])) else 1
    if argv[:1] == ["wait"]:
        return wait_healthy(argv[1], float(argv[2]), argv[3])
    print(f"usage: port PORT | wait URL TIMEOUT_S NAME (got {argv})", file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
