"""The served-benchmark client against a loopback server speaking SGLang's native HTTP protocol."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_dagster.bench.served import ServedBenchmarkError, run_served_benchmark

# A stand-in SGLang server in its own process: /health, /server_info (0.5.23 shape: internal_states),
# /generate with meta_info.{completion_tokens, spec_verify_ct, e2e_latency}. With --accept A each
# verify step commits A tokens; --fail-after N makes request N+1 either kill the process or hang up.
_SERVER = textwrap.dedent('''
    import argparse, json, math, os, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--accept", type=int, default=0)
    ap.add_argument("--fail-after", type=int, default=-1)
    ap.add_argument("--failure", choices=["exit", "hangup"], default="exit")
    args = ap.parse_args()
    lock = threading.Lock()
    state = {"requests": 0, "tokens": 0, "verify": 0}

    class H(BaseHTTPRequestHandler):
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
            if self.path == "/health":
                return self._json({})
            if self.path == "/server_info":
                avg = state["tokens"] / state["verify"] if state["verify"] else None
                return self._json({"internal_states": [{"avg_spec_accept_length": avg}]})
            self._json({"detail": "Not Found"}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["requests"] += 1
                failing = 0 <= args.fail_after < state["requests"]
            if failing and args.failure == "exit":
                os._exit(1)
            if failing:
                self.close_connection = True
                self.connection.shutdown(2)
                return
            ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            meta = {"id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(ids),
                    "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 0.01}
            if args.accept:
                meta["spec_verify_ct"] = math.ceil(n / args.accept)
                with lock:
                    state["tokens"] += n
                    state["verify"] += meta["spec_verify_ct"]
            self._json({"text": "x" * n, "output_ids": [sum(ids) % 7] * n, "meta_info": meta})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
''')

PROMPTS = {
    "mtbench": [(f"m{i}", list(range(3, 10 + i))) for i in range(6)],
    "gsm8k": [(f"g{i}", list(range(20, 25 + i))) for i in range(4)],
}


@pytest.fixture
def launcher(tmp_path: Path):
    script = tmp_path / "fake_sglang.py"
    script.write_text(_SERVER)
    procs: list[subprocess.Popen] = []

    def make(*args: str):
        @contextlib.contextmanager
        def launch() -> Iterator[str]:
            proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            try:
                yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
            finally:
                proc.terminate()
                proc.wait(timeout=10)

        return launch

    yield make, procs
    for p in procs:
        if p.poll() is None:
            p.kill()


def test_speculative_server_rows_report_sglang_acceptance_length(launcher):
    make, _ = launcher
    rows = run_served_benchmark(make("--accept", "3"), PROMPTS, method="eagle3", spec="3,1,4",
                                max_new_tokens=12, concurrency=3)
    assert [r["set"] for r in rows] == ["mtbench", "gsm8k"]
    for r, n in zip(rows, (6, 4)):
        assert r["num_prompts"] == n
        assert r["completion_tokens"] == 12 * n
        assert r["verify_ct"] == 4 * n
        assert r["acceptance_length"] == 3.0
        assert r["server_avg_accept_length"] == 3.0
        assert r["tokens_per_s"] > 0 and r["latency_p90_s"] >= r["latency_p50_s"] > 0
        assert r["server_e2e_latency_mean_s"] == pytest.approx(0.01)
    assert rows[0]["prompt_tokens"] == sum(len(ids) for _, ids in PROMPTS["mtbench"])


def test_plain_server_rows_have_no_acceptance_length(launcher):
    make, _ = launcher
    rows = run_served_benchmark(make(), PROMPTS, method="no_spec", spec=None, max_new_tokens=5)
    assert all(r["acceptance_length"] is None and r["verify_ct"] == 0 for r in rows)


def test_server_without_speculation_is_refused_when_speculation_was_requested(launcher):
    make, procs = launcher
    with pytest.raises(ServedBenchmarkError, match="no spec_verify_ct.*--speculative-algorithm"):
        run_served_benchmark(make(), PROMPTS, method="eagle3", spec="3,1,4", max_new_tokens=5)
    assert procs[0].poll() is not None


@pytest.mark.parametrize("failure", ["exit", "hangup"])
def test_server_dying_mid_run_names_server_and_prompt_and_is_stopped(launcher, failure):
    make, procs = launcher
    with pytest.raises(ServedBenchmarkError) as err:
        run_served_benchmark(make("--accept", "2", "--fail-after", "3", "--failure", failure), PROMPTS,
                             method="eagle3", spec="3,1,4", max_new_tokens=8, concurrency=1)
    message = str(err.value)
    assert "SGLang server http://127.0.0.1:" in message
    assert "prompt mtbench/m3" in message  # sequential requests: the fourth one is the first to fail
    expected = "no longer answers /health" if failure == "exit" else "still answers /health"
    assert expected in message
    assert procs[0].poll() is not None  # the launch context stopped (or reaped) the server process


def test_prompt_sets_load_from_local_files_with_size_and_source(tmp_path):
    import orjson

    from eagle3_dagster.bench.prompts import load_prompt_set

    def jsonl(name, records):
        path = tmp_path / name
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
        return path

    gsm = jsonl("gsm8k.jsonl", [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(5)])
    mt = jsonl("mt.jsonl", [{"id": "81", "turns": ["Write a travel blog.", "Rewrite it."]}])
    he = jsonl("he.jsonl", [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n"}])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    tool = jsonl("tools.jsonl", [{"id": "t0", "tools": tools, "messages": [
        {"role": "system", "content": "You can call tools."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "ignored"}]}])

    gsm_set = load_prompt_set("gsm8k", 3, gsm)
    assert gsm_set.describe() == {"num_prompts": 3, "source": str(gsm)}
    assert gsm_set.prompts[1].messages == ({"role": "user", "content": "What is 1 + 1?"},)
    mt_messages = load_prompt_set("mtbench", 10, mt).prompts[0].messages
    assert mt_messages == ({"role": "user", "content": "Write a travel blog."},)
    assert "def add(a, b):" in load_prompt_set("humaneval", 1, he).prompts[0].messages[0]["content"]
    tool_prompt = load_prompt_set("tool_use", 1, tool).prompts[0]
    assert [m["role"] for m in tool_prompt.messages] == ["system", "user"]
    assert tool_prompt.tools[0]["function"]["name"] == "get_weather"


def test_a_prompt_record_without_a_prompt_field_is_named_in_the_error(tmp_path):
    from eagle3_dagster.bench.prompts import load_prompt_set

    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok?"}\n{"answer": "no prompt here"}\n')
    with pytest.raises(ValueError, match=r"prompt set gsm8k: record 1 of .*bad.jsonl"):
        load_prompt_set("gsm8k", 5, path)
