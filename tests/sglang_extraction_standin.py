"""A stand-in for `python -m sglang.launch_server` in extraction mode, for CPU tests.

Installed as `sglang/launch_server.py` in a test site (tests/sglang_wheels.make_site) next to a real,
patched `deepseek_v2.py`, so the GPU-host code runs its real command line. It refuses options the
release does not have the way argparse would (exit 2), serves SGLang's endpoints the way the
releases do (`/health_generate` 503 while loading, `/v1/models` naming `--served-model-name`,
native `/generate` with `meta_info`), and answers each prefill by running the target with
transformers and driving the real dump hook (`eagle3_dagster.sglang.dump_hook`, configured from
SGLANG_HS_DUMP_DIR / SGLANG_HS_DUMP_LAYERS as in the patched server) with a forward batch shaped
like SGLang's: EXTEND mode, `rids`, `input_ids`, `extend_seq_lens` / `extend_prefix_lens`, and the
Kimi-K2.5 convention of no `input_ids` argument (the hook reads the batch's).
"""

import json
import sys
import threading
from enum import Enum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch

KNOWN = {
    "--model-path",
    "--tp-size",
    "--host",
    "--port",
    "--served-model-name",
    "--trust-remote-code",
    "--context-length",
    "--disable-radix-cache",
    "--chunked-prefill-size",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--disable-piecewise-cuda-graph",
    "--disable-prefill-cuda-graph",
    "--enforce-disable-flashinfer-allreduce-fusion",
}
REQUIRED = {"--disable-radix-cache", "--chunked-prefill-size", "--disable-cuda-graph"}


class ForwardMode(Enum):
    EXTEND = 1


def main(argv: list[str]) -> None:
    flags = {a for a in argv if a.startswith("--")}
    unknown, missing = flags - KNOWN, REQUIRED - flags
    if unknown or missing:
        print(f"launch_server: error: unrecognized {sorted(unknown)} / missing {sorted(missing)}", flush=True)
        sys.exit(2)
    port = int(argv[argv.index("--port") + 1])
    name = argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else None
    model_path = argv[argv.index("--model-path") + 1]
    state = {"ready": False}
    lock = threading.Lock()

    from eagle3_dagster.sglang import dump_hook

    dump_hook._default_rank = lambda: 0  # TP rank 0: there is no sglang.srt parallel state here

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send(200, {"data": [{"id": name}]})
            self._send(200 if state["ready"] else 503, {})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = req["input_ids"]
            with lock:  # one forward at a time, as SGLang's scheduler runs them
                prefill(ids, req.get("rid"))
            self._send(
                200,
                {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {
                        "id": req.get("rid"),
                        "prompt_tokens": len(ids),
                        "completion_tokens": 0,
                        "cached_tokens": 0,
                    },
                },
            )

    def prefill(ids: list[int], rid: str | None) -> None:
        input_ids = torch.tensor(ids, dtype=torch.int64)
        batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            rids=[rid],
            input_ids=input_ids,
            extend_seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
            extend_seq_lens_cpu=[len(ids)],
            extend_prefix_lens=torch.tensor([0], dtype=torch.int32),
            extend_prefix_lens_cpu=[0],
        )
        with torch.inference_mode():
            out = model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
        states = out.hidden_states
        for i in range(len(states) - 1):  # the residual stream entering layer i (residual None: a plain sum)
            dump_hook.capture_layer_input(i, states[i][0], None, batch)
        dump_hook.capture_final(out.last_hidden_state[0], batch)
        dump_hook.get_dumper().flush()

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    serving = threading.Thread(target=httpd.serve_forever, daemon=True)  # 503 while the model loads
    serving.start()
    print("stand-in sglang: loading", flush=True)
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()
    state["ready"] = True
    print("stand-in sglang: ready", flush=True)
    serving.join()  # until the GPU-host code stops the process group


if __name__ == "__main__":
    main(sys.argv[1:])
