"""A stand-in for `python -m sglang.launch_server` in serving mode, for tests (SGLang cannot run here).

Run as a script with SGLang's own arguments. It behaves as the releases' http_server.py does
where the benchmark depends on it:
- `/health` and `/health_generate` answer 503 while "loading" (STANDIN_LOAD_S seconds), then 200;
- `/model_info` carries `served_model_name` only from 0.5.18 on (STANDIN_RELEASE, default 0.5.23);
  `/v1/models` lists it as `data[].id` in every release;
- `/generate` takes `input_ids` + `sampling_params`, refuses (HTTP 400) a request whose prompt plus
  max_new_tokens exceeds `--context-length`, and with `--speculative-algorithm` sends
  `meta_info.spec_verify_ct` and `spec_accept_length = completion_tokens / spec_verify_ct` (0.5.23's
  tokenizer_manager fields); each verify step commits STANDIN_ACCEPT tokens (default: draft tokens - 1);
- `/server_info` has `internal_states[0].avg_spec_accept_length` (total tokens / total verify steps).
The completion length depends on the prompt, so per-request acceptance lengths differ.
STANDIN_NAME overrides the served name (a server that is not the one launched); STANDIN_FAIL_AFTER=N
makes request N+1 kill the process (STANDIN_FAILURE=exit) or hang up (hangup).
"""

import argparse
import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--model-path", required=True)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=30000)
ap.add_argument("--served-model-name")
ap.add_argument("--context-length", type=int, default=4096)
ap.add_argument("--speculative-algorithm")
ap.add_argument("--speculative-num-draft-tokens", type=int, default=4)
args, _ = ap.parse_known_args()
release = tuple(int(x) for x in os.environ.get("STANDIN_RELEASE", "0.5.23").split(".")[:3])
name = os.environ.get("STANDIN_NAME") or args.served_model_name or args.model_path
accept = int(os.environ.get("STANDIN_ACCEPT", args.speculative_num_draft_tokens - 1))
fail_after = int(os.environ.get("STANDIN_FAIL_AFTER", "-1"))
ready_at = time.monotonic() + float(os.environ.get("STANDIN_LOAD_S", "0.3"))
lock = threading.Lock()
state = {"requests": 0, "tokens": 0, "verify": 0}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, obj, code=200):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path in ("/health", "/health_generate"):
            return self._json({}, 200 if time.monotonic() > ready_at else 503)
        if self.path == "/model_info":
            info = {"model_path": args.model_path, "is_generation": True}
            if release >= (0, 5, 18):
                info["served_model_name"] = name
            return self._json(info)
        if self.path == "/v1/models":
            return self._json(
                {
                    "object": "list",
                    "data": [{"id": name, "root": name, "object": "model", "max_model_len": args.context_length}],
                }
            )
        if self.path == "/server_info":
            avg = state["tokens"] / state["verify"] if state["verify"] else None
            return self._json(
                {
                    "served_model_name": name,
                    "port": args.port,
                    "version": ".".join(map(str, release)),
                    "internal_states": [{"avg_spec_accept_length": avg}],
                }
            )
        self._json({"detail": "Not Found"}, 404)

    def do_POST(self):
        if self.path != "/generate":
            return self._json({"detail": "Not Found"}, 404)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            state["requests"] += 1
            failing = 0 <= fail_after < state["requests"]
        if failing and os.environ.get("STANDIN_FAILURE", "exit") == "exit":
            os._exit(1)
        if failing:
            self.close_connection = True
            self.connection.shutdown(2)
            return
        ids, max_new = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        if len(ids) + max_new > args.context_length:
            return self._json(
                {
                    "error": {
                        "message": f"Requested token count exceeds the model's maximum context "
                        f"length of {args.context_length} tokens. You requested a total of "
                        f"{len(ids) + max_new} tokens",
                        "code": 400,
                    }
                },
                400,
            )
        n = min(max_new, 4 + sum(ids) % 9)
        meta = {
            "id": f"req-{state['requests']}",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": 0.01,
        }
        if args.speculative_algorithm:
            verify = math.ceil(n / accept)
            meta |= {
                "spec_verify_ct": verify,
                "spec_accept_length": n / verify,
                "spec_num_correct_drafts": n - verify,
                "spec_num_proposed_drafts": verify * (args.speculative_num_draft_tokens - 1),
            }
            with lock:
                state["tokens"] += n
                state["verify"] += verify
        self._json({"text": "x" * n, "output_ids": [sum(ids) % 7] * n, "meta_info": meta})


server = ThreadingHTTPServer((args.host, args.port), Handler)
print(f"stand-in sglang {'.'.join(map(str, release))} serving {name} on {args.host}:{args.port}", flush=True)
server.serve_forever()
