"""The served benchmark against a stand-in SGLang server process speaking the releases' HTTP protocol.

The client runs where the server is reachable: on the GPU host, started through `GpuHost` (local
transport here), reading its prompts from a file written on the host. The stand-in
(tests/sglang_standin.py) answers 503 while loading, names itself the way each release does and
sends the per-request and server-wide acceptance figures SGLang sends.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_dagster.bench.served import ServedBenchmarkError, prompt_token_limit, run_on_host, run_served_sets
from eagle3_dagster.drafter.export import export_drafter
from eagle3_dagster.gpu_host import GpuHost
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.sglang.server import ServerError, ServerSpec
from tests.loopback_http import LoopbackHTTPServer
from tests.sshd_server import free_port
from tests.unit.test_export import _drafter, target_dir  # noqa: F401  (target_dir is a fixture)
from eagle3_dagster.stages.bench import BenchSettings

pytestmark = pytest.mark.slow  # stand-in SGLang server processes on the host

STANDIN = Path(__file__).resolve().parents[1] / "sglang_standin.py"
SPEC_ARGS = (
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
)
PROMPTS = {
    "mtbench": [(f"m{i}", list(range(3, 10 + i))) for i in range(6)],
    "gsm8k": [(f"g{i}", list(range(20, 25 + i))) for i in range(4)],
}


def _expected(ids, max_new, accept):
    """What the stand-in generates for a prompt: completion tokens and verify steps."""
    n = min(max_new, 4 + sum(ids) % 9)
    return n, math.ceil(n / accept)


@pytest.fixture
def direct_server():
    """A stand-in started directly (no loading phase); yields (base_url, served name)."""
    procs = []

    def start(*args: str, env: dict | None = None) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                str(STANDIN),
                "--model-path",
                "/models/t",
                "--port",
                str(port),
                "--served-model-name",
                "ours",
                *args,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/bin:/bin", "STANDIN_LOAD_S": "0", **(env or {})},
        )
        procs.append(proc)
        assert "serving" in proc.stdout.readline()  # printed once the port is bound
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def _host(tmp_path) -> GpuHost:
    return GpuHost(HostConfig(python=sys.executable, workdir=str(tmp_path / "work")))


def _server(port: int, *extra: str, context: int | None = 4096, **env: str) -> ServerSpec:
    return ServerSpec(
        model_path="/models/tiny",
        port=port,
        context_length=context,
        extra_args=extra,
        launcher=(sys.executable, str(STANDIN)),
        health_timeout_s=60,
        env=env,
    )


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_client_reports_its_acceptance_length_next_to_sglangs_own(direct_server):
    url = direct_server(*SPEC_ARGS)
    rows = run_served_sets(
        url, PROMPTS, method="eagle3", spec="3,1,4", max_new_tokens=12, concurrency=3, served_model_name="ours"
    )
    assert [r["set"] for r in rows] == ["mtbench", "gsm8k"]
    total_n = total_v = 0
    for row, prompts in zip(rows, PROMPTS.values()):
        done = [_expected(ids, 12, 3) for _, ids in prompts]
        n, v = sum(d[0] for d in done), sum(d[1] for d in done)
        total_n, total_v = total_n + n, total_v + v
        assert row["num_prompts"] == len(prompts) and row["completion_tokens"] == n and row["verify_ct"] == v
        assert row["acceptance_length"] == pytest.approx(n / v)  # the client's: sum over sum
        assert row["sglang_request_accept_length_mean"] == pytest.approx(sum(a / b for a, b in done) / len(done))
        assert row["num_requests_with_accept_length"] == len(prompts)
        assert row["server_avg_accept_length"] == pytest.approx(total_n / total_v)  # cumulative since launch
        assert row["tokens_per_s"] > 0 and row["latency_p90_s"] >= row["latency_p50_s"] > 0
        assert row["server_e2e_latency_mean_s"] == pytest.approx(0.01)
    assert rows[0]["sglang_request_accept_length_mean"] != pytest.approx(rows[0]["acceptance_length"])
    assert rows[0]["prompt_tokens"] == sum(len(ids) for _, ids in PROMPTS["mtbench"])


def test_plain_server_rows_have_no_acceptance_figures(direct_server):
    rows = run_served_sets(direct_server(), PROMPTS, method="no_spec", spec=None, max_new_tokens=5)
    assert all(r["acceptance_length"] is None and r["verify_ct"] == 0 for r in rows)
    assert all(r["sglang_request_accept_length_mean"] is None and r["server_avg_accept_length"] is None for r in rows)


def test_server_without_speculation_is_refused_when_speculation_was_requested(direct_server):
    with pytest.raises(ServedBenchmarkError, match="no spec_verify_ct.*--speculative-algorithm"):
        run_served_sets(direct_server(), PROMPTS, method="eagle3", spec="3,1,4", max_new_tokens=5)


@pytest.mark.parametrize("release", ["0.5.14", "0.5.23"])
def test_client_refuses_a_server_answering_under_another_name(direct_server, release):
    url = direct_server(env={"STANDIN_RELEASE": release})
    with pytest.raises(ServedBenchmarkError, match=r"serves \['ours'\], not 'theirs'"):
        run_served_sets(url, PROMPTS, method="no_spec", spec=None, max_new_tokens=5, served_model_name="theirs")


class _NoModelList(LoopbackHTTPServer):
    """A server with no /model_info (404) whose /v1/models answers HTTP 500."""

    def _handler(self):
        from http.server import BaseHTTPRequestHandler

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(500 if self.path == "/v1/models" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


def test_client_refuses_a_server_whose_model_list_answers_an_error_naming_the_status():
    with _NoModelList() as server:
        url = server.url.removesuffix("/v1")
        with pytest.raises(ServedBenchmarkError, match=rf"^SGLang server {url}: /v1/models answered HTTP 500$"):
            run_served_sets(url, PROMPTS, method="no_spec", spec=None, max_new_tokens=5, served_model_name="ours")


@pytest.mark.parametrize("release", ["0.5.14", "0.5.23"])  # name from /v1/models only; from /model_info too
def test_benchmark_client_runs_on_the_gpu_host_beside_the_server(tmp_path, release):
    host, port, logs = _host(tmp_path), free_port(), []
    rows = run_on_host(
        host,
        _server(port, *SPEC_ARGS, STANDIN_RELEASE=release, STANDIN_LOAD_S="1"),
        PROMPTS,
        method="eagle3",
        spec="3,1,4",
        max_new_tokens=12,
        concurrency=2,
        log=logs.append,
    )
    assert [(r["set"], r["method"], r["spec"]) for r in rows] == [
        ("mtbench", "eagle3", "3,1,4"),
        ("gsm8k", "eagle3", "3,1,4"),
    ]
    n, v = map(sum, zip(*[_expected(ids, 12, 3) for _, ids in PROMPTS["mtbench"]]))
    assert rows[0]["acceptance_length"] == pytest.approx(n / v)
    launched = next(line for line in logs if line.startswith("[sglang] stand-in sglang"))
    nonce = launched.split(" serving ")[1].split(" on ")[0]
    assert nonce.startswith("eagle3-") and len(nonce) > 20  # a fresh --served-model-name per launch
    written = (tmp_path / "work" / "bench" / f"prompts-{nonce}.jsonl").read_text().splitlines()
    assert [json.loads(line)["input_ids"] for line in written] == [ids for s in PROMPTS.values() for _, ids in s]
    assert not (tmp_path / "work" / f"sglang-{port}.pid").exists()  # the server was stopped


def test_a_foreign_server_on_the_port_is_refused_before_launching(tmp_path, direct_server):
    url = direct_server(env={"STANDIN_NAME": "someone-elses-model"})
    port, logs = int(url.rsplit(":", 1)[1]), []
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"already answers on 127.0.0.1:{port}"):
        run_on_host(
            _host(tmp_path), _server(port), PROMPTS, method="no_spec", spec=None, max_new_tokens=5, log=logs.append
        )
    assert not any(line.startswith("[sglang]") for line in logs), "a server was launched anyway"
    assert time.monotonic() - start < 30


def test_a_healthy_server_answering_under_another_name_is_not_taken_as_ours(tmp_path):
    port = free_port()
    with pytest.raises(ServerError, match=r"not ours.*\['impostor'\]"):
        run_on_host(
            _host(tmp_path),
            _server(port, STANDIN_NAME="impostor"),
            PROMPTS,
            method="no_spec",
            spec=None,
            max_new_tokens=5,
        )
    assert not (tmp_path / "work" / f"sglang-{port}.pid").exists()


@pytest.mark.parametrize("failure", ["exit", "hangup"])
def test_server_dying_mid_run_names_server_and_prompt_and_is_stopped(tmp_path, failure):
    port, logs = free_port(), []
    with pytest.raises(ServedBenchmarkError) as err:
        run_on_host(
            _host(tmp_path),
            _server(port, *SPEC_ARGS, STANDIN_FAIL_AFTER="3", STANDIN_FAILURE=failure),
            PROMPTS,
            method="eagle3",
            spec="3,1,4",
            max_new_tokens=8,
            concurrency=1,
            log=logs.append,
        )
    message = str(err.value)
    assert f"SGLang server http://127.0.0.1:{port}" in message
    assert "prompt mtbench/m3" in message  # sequential requests: the fourth one is the first to fail
    assert ("no longer answers /health" if failure == "exit" else "still answers /health") in message
    assert not (tmp_path / "work" / f"sglang-{port}.pid").exists()


def test_prompts_are_capped_at_the_serving_context(tmp_path):
    assert prompt_token_limit(2048, 256) == 1792
    assert prompt_token_limit(2048, 256, max_prompt_tokens=1000) == 1000
    with pytest.raises(ValueError, match=r"bench.max_new_tokens \(2048\).*target.serving_context \(2048\)"):
        prompt_token_limit(2048, 2048)
    port, logs = free_port(), []
    too_long = {"mtbench": [("ok", [1] * 8), ("long", [1] * 20)]}
    with pytest.raises(ValueError, match=r"prompt mtbench/long: 20 tokens \+ max_new_tokens 8 exceed .* 24"):
        run_on_host(
            _host(tmp_path),
            _server(port, context=24),
            too_long,
            method="no_spec",
            spec=None,
            max_new_tokens=8,
            log=logs.append,
        )
    assert not logs  # refused before any server was started
    fitting = {"mtbench": [("ok", [1] * 8), ("edge", [1] * 16)]}
    rows = run_on_host(
        _host(tmp_path), _server(port, context=24), fitting, method="no_spec", spec=None, max_new_tokens=8
    )
    assert rows[0]["num_prompts"] == 2


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
    tool = jsonl(
        "tools.jsonl",
        [
            {
                "id": "t0",
                "tools": tools,
                "messages": [
                    {"role": "system", "content": "You can call tools."},
                    {"role": "user", "content": "Weather in Oslo?"},
                    {"role": "assistant", "content": "ignored"},
                ],
            }
        ],
    )

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


def _standin_host_python(tmp_path, version: str) -> Path:
    """A host interpreter whose `sglang` is release `version` (`__version__`) and whose launch_server is the stand-in."""
    import shutil

    site = tmp_path / "site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(f'__version__ = "{version}"\n')
    shutil.copy(STANDIN, site / "launch_server.py")
    python = tmp_path / "python"
    root = Path(__file__).resolve().parents[2]
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}:{root}" STANDIN_LOAD_S=0.5 exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    return python


def _bench_profile(tmp_path, port: int, **gpu_host):
    from eagle3_dagster.config import load_profile

    return load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "gpu_host": gpu_host,
            "hidden": {"backend": "sglang", "sglang_port": port, "root": str(tmp_path / "run" / "hidden_states")},
            "bench": {
                "mode": "served",
                "sets": ["gsm8k"],
                "num_prompts": 2,
                "max_new_tokens": 16,
                "spec_configs": [[3, 1, 4]],
            },
        },
    )


@pytest.mark.parametrize("case", ["export", "profile"])
def test_served_benchmark_refuses_a_host_release_the_export_or_profile_does_not_name(tmp_path, target_dir, case):
    """The export's aux ids are right on `eagle3_dagster_sglang.releases` only; 0.5.13 reads 0.5.12's ids
    for a non-default aux set one layer off. Refused before any server starts, naming both releases."""
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.gpu_host import PreflightError
    from eagle3_dagster.stages.bench import benchmark_stage

    port = free_port()
    profile = _bench_profile(tmp_path, port, **({"sglang_version": "0.5.12"} if case == "profile" else {}))
    export = export_drafter(
        _drafter(target_dir),
        tmp_path / "export",
        serving_context=4096,
        sglang_versions=["0.5.12"] if case == "export" else None,
    )
    host = GpuHost(HostConfig(python=str(_standin_host_python(tmp_path, "0.5.13")), workdir=str(tmp_path / "work")))
    logs: list[str] = []
    want = (
        r"SGLang 0\.5\.13\b.*0\.5\.12"
        if case == "export"
        else r"SGLang 0\.5\.13 installed.*gpu_host\.sglang_version is 0\.5\.12"
    )
    with pytest.raises((ValueError, PreflightError), match=want):
        benchmark_stage(
            BenchSettings.from_profile(profile),
            ArtifactLayout.from_profile(profile),
            export_dir=export,
            previous_results=None,
            run_id="r1",
            gpu_host=host,
            progress=logs.append,
        )
    assert not any(line.startswith("[sglang]") for line in logs), "a server was launched anyway"


def test_benchmark_stage_serves_through_sglang_on_the_gpu_host(tmp_path, micro_target, target_dir):
    """The stage end to end: prompts rendered and capped here, each server + client on the host.

    The host's interpreter is a wrapper whose `sglang.launch_server` is the stand-in, so the stage
    starts "SGLang" exactly as in production (`python -m sglang.launch_server ...`).
    """
    import shutil

    import orjson

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.stages.bench import benchmark_stage

    python = _standin_host_python(tmp_path, "0.5.23")
    questions = [f"What is {i} plus {i}?" for i in range(4)] + ["Explain this. " + "word " * 2000]
    prompts = tmp_path / "gsm8k.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"question": q, "answer": "x"}) + b"\n" for q in questions))
    port = free_port()
    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "hidden": {"backend": "sglang", "sglang_port": port, "root": str(tmp_path / "run" / "hidden_states")},
            "bench": {
                "mode": "served",
                "sets": ["gsm8k"],
                "set_paths": {"gsm8k": str(prompts)},
                "num_prompts": 5,
                "max_new_tokens": 16,
                "spec_configs": [[3, 1, 4]],
                "concurrency": 2,
            },
        },
    )
    layout = ArtifactLayout.from_profile(profile)
    shutil.copytree(micro_target, layout.target_dir)
    host = GpuHost(HostConfig(python=str(python), workdir=str(tmp_path / "work")))
    logs: list[str] = []
    export = export_drafter(_drafter(target_dir), tmp_path / "export", serving_context=4096)  # the project's own
    report = benchmark_stage(
        BenchSettings.from_profile(profile),
        layout,
        export_dir=export,
        previous_results=None,
        run_id="r1",
        gpu_host=host,
        progress=logs.append,
    )
    assert report.metadata["drafter_source"] == "eagle3_dagster"
    results = json.loads(Path(report.metadata["results_json"]).read_text())
    rows = {r["method"]: r for r in results["rows"]}
    assert set(rows) == {"no_spec", "eagle3"} and rows["eagle3"]["spec"] == "3,1,4"
    assert rows["no_spec"]["num_prompts"] == rows["eagle3"]["num_prompts"] == 4  # the long question left out
    assert results["sets"]["gsm8k"]["num_left_out_over_context"] == 1
    assert results["sets"]["gsm8k"]["max_prompt_tokens"] == profile.target.serving_context - 16
    assert rows["eagle3"]["acceptance_length"] > 1 and rows["eagle3"]["server_avg_accept_length"] > 1
    assert rows["no_spec"]["acceptance_length"] is None
    launches = [line for line in logs if line.startswith("[sglang] stand-in sglang")]
    assert len(launches) == 2 and launches[0] != launches[1]  # two servers, each with its own name
    assert not (tmp_path / "work" / f"sglang-{port}.pid").exists()
