"""Prefill throughput of SGLang's own server dumping hidden states, against the same release unpatched.

    python benchmarks/sglang_prefill.py [--rounds 12] [--requests 8] [--tokens 384] [--model-dir DIR]
    python benchmarks/sglang_prefill.py --patched-python A/bin/python --pristine-python B/bin/python --model-dir DIR
        (a GPU host: two interpreters with the same release installed, no CPU options)

Two venvs of one SGLang release, both built by the sglang tier's builder (tests/sglang_cpu/venv.py): the
tier's own, with the production dump patch applied (`eagle3 patch apply --python`, as on a GPU host), and a
second one of the same inputs ("pristine", `.cache/sglang-venv/<version>-pristine/`) that `eagle3 patch
revert` proves unpatched by sha256. Both servers run at once, started by the project's launcher with the
same ServerSpec but the port: the release's extraction options (patches/sglang/releases.json: radix cache
off, whole prompts per forward, no CUDA graphs), the tier's CPU options and three that a pair of servers on a
CPU needs (a KV pool for a whole round, a static memory fraction, --sleep-on-idle: see `main`), the same target,
the same environment (`SGLANG_HS_DUMP_DIR` included: the pristine release has no code that reads it, and its
dump folder is checked to stay empty).

Each round sends the same `--requests` prompts of `--tokens` random ids to each side, one side after the other
(A = pristine, B = patched):
- pristine: the extraction driver's own prefill request (`/generate`, `max_new_tokens: 0`) for every prompt,
  all in flight at once;
- patched: what extraction runs, `extract_shard_sglang` with the same concurrency: the dump hook writes chunk
  files into a temp folder inside the server's forward, the driver stitches them by position, checks them and
  commits a bfloat16 shard (fsync, sha256, manifest) into a temp folder;
- and, to say where the patched side's time goes, "patched, requests only": the pristine side's requests sent to
  the patched server (the hook dumping; its chunk files removed after the side, untimed).
Order: A C B, B C A, ... (C = requests only).
A side's prefill tokens/s is the round's tokens over its wall seconds. Printed: per side the median (min-max)
over rounds, the ratio of the medians patched / pristine (goal: at least 0.90), the ratio per round and of each
side's fastest round (where other work shares the machine, the least disturbed one), and every round, with the CPU
seconds of each server's process tree and of this process (the driver's share) for the same rounds, and of the
idle server meanwhile.

Without --model-dir the target is a DeepSeek-V3 of the demo's size (configs/demo.yaml target.tiny: hidden 128,
8 layers, 8 routed experts), built by the tiny target's own builder with one pre-training step (the weights do
not matter for timing). At that size and 384 tokens a request, 8 requests per round, the prefill forward
dominates what a request costs besides it (HTTP, tokenizer manager, scheduler): after the rounds the script
times a round of 1-token prompts on the pristine server, the cost of a round without its forward's tokens,
and prints its share of a pristine round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tier's venv builder lives in tests/

from eagle3_dagster.gpu_host import GpuHost  # noqa: E402  (the checkout is put on sys.path above)
from eagle3_dagster.host_config import HostConfig  # noqa: E402  (the checkout is put on sys.path above)
from eagle3_dagster.hidden.sharding import SampleRecord, plan_shards  # noqa: E402  (the checkout is put on sys.path above)
from eagle3_dagster.layers import default_aux_layers  # noqa: E402  (the checkout is put on sys.path above)
from eagle3_dagster.sglang.driver import DriverSettings, extract_shard_sglang, prefill  # noqa: E402  (the checkout is put on sys.path above)
from eagle3_dagster.sglang.server import LogTail, ServerSpec, sglang_server  # noqa: E402  (the checkout is put on sys.path above)
from eagle3_dagster.target import load_target_config  # noqa: E402  (the checkout is put on sys.path above)
from tests.real_sglang.support import free_port  # noqa: E402  (the checkout is put on sys.path above)
from tests.sglang_cpu import venv as sglang_venv  # noqa: E402  (the checkout is put on sys.path above)

VERSION = "0.5.23"
PRISTINE = "pristine"
REQUESTS = "patched, requests only"  # the patched server dumping, the driver's requests without its stitching
SERVER = {PRISTINE: PRISTINE, "patched": "patched", REQUESTS: "patched"}


def build_target(out: Path, profile: str) -> Path:
    """The profile's tiny target, pre-trained for one step: SGLang loads the same files as the demo's."""
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.tiny.build import build_tiny_target

    tiny = load_profile(profile).target.tiny
    one_step = tiny.pretrain_seq_len * tiny.pretrain_batch_size
    build_tiny_target(tiny.model_copy(update={"pretrain_tokens": one_step, "tokenizer_train_conversations": 300}), out)
    return out


def tree_cpu_seconds(root_pid: int) -> float:
    """User + system CPU seconds of a process and every live descendant (/proc)."""
    parent, cpu = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [root_pid]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return total


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def prefill_all(base_url: str, records: list[SampleRecord]) -> None:
    """The pristine side: the driver's prefill request for every record, all in flight at once."""
    limits = httpx.Limits(max_connections=len(records))
    with (
        httpx.Client(base_url=base_url, timeout=600.0, limits=limits) as client,
        ThreadPoolExecutor(len(records)) as pool,
    ):
        for meta in pool.map(lambda r: prefill(client, r), records):
            assert meta.get("prompt_tokens", 0) > 0, meta


def round_samples(path: Path, rnd: int, requests: int, tokens: int, vocab: int) -> list[SampleRecord]:
    g = torch.Generator().manual_seed(rnd)
    records = [
        SampleRecord(f"bench/r{rnd}/{k}", torch.randint(3, vocab, (tokens,), generator=g).tolist(), [1] * tokens)
        for k in range(requests)
    ]
    path.write_bytes(
        b"".join(
            orjson.dumps({"id": r.id, "dataset": "bench", "input_ids": r.input_ids, "loss_mask": r.loss_mask}) + b"\n"
            for r in records
        )
    )
    return records


def median_range(values: list[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=VERSION, help="the SGLang release (one the tier's venv builder knows)")
    ap.add_argument("--model-dir", type=Path, help="a target SGLang serves (default: the --profile's tiny target)")
    ap.add_argument("--profile", default="demo", help="whose target.tiny to build without --model-dir")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=8, help="prompts per round, all in flight at once")
    ap.add_argument("--tokens", type=int, default=384, help="tokens per prompt")
    ap.add_argument("--workdir", type=Path, help="keep targets, dumps, shards and server logs here")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument(
        "--patched-python",
        type=Path,
        help="with --pristine-python: two interpreters with the release "
        "installed (a GPU host's), used instead of the tier's CPU venvs and launched without the CPU "
        "options; the dump patch is applied to this one and reverted on the other all the same",
    )
    ap.add_argument("--pristine-python", type=Path)
    args = ap.parse_args()
    if (args.patched_python is None) != (args.pristine_python is None):
        ap.error("--patched-python and --pristine-python go together")
    on_cpu = args.patched_python is None
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)

    with contextlib.ExitStack() as stack:
        tmp = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sglang-prefill-")))
        tmp.mkdir(parents=True, exist_ok=True)
        log = lambda line: print(f"[venv] {line}", file=sys.stderr)  # noqa: E731  (a one-line logger for the venv builder)
        pythons = (
            {
                PRISTINE: sglang_venv.build(args.version, log=log, variant=PRISTINE),
                "patched": sglang_venv.build(args.version, log=log),
            }
            if on_cpu
            else {PRISTINE: args.pristine_python, "patched": args.patched_python}
        )
        print(sglang_venv.dump_patch(pythons[PRISTINE], "revert"), file=sys.stderr)
        print(sglang_venv.dump_patch(pythons["patched"], "apply"), file=sys.stderr)
        model_dir = args.model_dir or build_target(tmp / "target", args.profile)
        config = load_target_config(model_dir)
        hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
        aux = default_aux_layers(layers)
        # Room for a whole round in the KV pool, so every round is one batch of prefills on both servers. SGLang's
        # own --mem-fraction-static on CPU comes out negative with the extraction's --chunked-prefill-size -1
        # ("Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=-0.046"); the pool is
        # capped by --max-total-tokens either way. SGLang's scheduler polls for requests in a busy loop unless
        # --sleep-on-idle (then it waits in zmq's poll, which returns as a request arrives): without it the idle
        # server of the pair took as much CPU as the measured one (5.7 against 7.9 CPU s a round), on 2 cores.
        extra = (
            (
                *sglang_venv.SERVER_ARGS,
                "--max-total-tokens",
                str(max(4096, 2 * args.requests * args.tokens)),
                "--mem-fraction-static",
                "0.5",
                "--sleep-on-idle",
            )
            if on_cpu
            else ()
        )
        running, dump_dirs, logs = {}, {}, {}
        for side, python in pythons.items():
            dump_dirs[side] = tmp / side / "dumps"
            spec = ServerSpec(
                model_path=str(model_dir),
                port=free_port(),
                dump_dir=str(dump_dirs[side]),
                dump_layers=tuple(aux),
                sglang_version=args.version,
                extra_args=extra,
                env=sglang_venv.server_env(python) if on_cpu else {},
                health_timeout_s=1800,
            )
            host = GpuHost(HostConfig(transport="local", python=str(python), workdir=str(tmp / side / "host")))
            logs[side] = stack.enter_context(contextlib.closing(LogTail(tmp / side / "sglang.log")))
            print(f"starting the {side} server ({python})", file=sys.stderr)
            running[side] = stack.enter_context(sglang_server(host, spec, on_log=logs[side]))

        sides = {
            PRISTINE: lambda rnd, merged, records: prefill_all(running[PRISTINE].base_url, records),
            "patched": lambda rnd, merged, records: _extract(
                running["patched"].base_url,
                dump_dirs["patched"],
                merged,
                tmp / "patched" / f"hs-{rnd:04d}",
                aux,
                hidden,
            ),
            REQUESTS: lambda rnd, merged, records: prefill_all(running["patched"].base_url, records),
        }
        for side in sides:  # warm-up: the first forwards allocate and load what later ones reuse
            merged = tmp / f"warmup-{side}.jsonl"
            sides[side](-1, merged, round_samples(merged, 10_000, args.requests, args.tokens, vocab))
            if side == REQUESTS:
                _remove_chunks(dump_dirs["patched"])

        figures: dict[str, dict[str, list[float]]] = {
            s: {"tok_s": [], "server_cpu_s": [], "driver_cpu_s": [], "idle_server_cpu_s": []} for s in sides
        }
        tokens = args.requests * args.tokens
        for rnd in range(args.rounds):
            merged = tmp / f"round-{rnd:04d}.jsonl"
            records = round_samples(merged, rnd, args.requests, args.tokens, vocab)
            order = [PRISTINE, REQUESTS, "patched"] if rnd % 2 == 0 else ["patched", REQUESTS, PRISTINE]
            for side in order:
                pid, other = (running[s].process.proc.pid for s in (SERVER[side], *(set(running) - {SERVER[side]})))
                cpu0, idle0, self0 = tree_cpu_seconds(pid), tree_cpu_seconds(other), self_cpu_seconds()
                t0 = time.perf_counter()
                sides[side](rnd, merged, records)
                wall = time.perf_counter() - t0
                figures[side]["tok_s"].append(tokens / wall)
                figures[side]["server_cpu_s"].append(tree_cpu_seconds(pid) - cpu0)
                figures[side]["driver_cpu_s"].append(self_cpu_seconds() - self0)
                figures[side]["idle_server_cpu_s"].append(tree_cpu_seconds(other) - idle0)
                if side == REQUESTS:  # the driver would have read and removed them
                    _remove_chunks(dump_dirs["patched"])
            print(
                f"round {rnd} ({' then '.join(order)}): "
                + ", ".join(f"{s} {figures[s]['tok_s'][-1]:,.0f} tok/s" for s in sides),
                file=sys.stderr,
            )
        assert not list(dump_dirs[PRISTINE].glob("*")), "the pristine server dumped: it is not the unpatched release"
        probe = []
        for rnd in range(3):
            merged = tmp / f"probe-{rnd}.jsonl"
            records = round_samples(merged, 20_000 + rnd, args.requests, 1, vocab)
            t0 = time.perf_counter()
            sides[PRISTINE](rnd, merged, records)
            probe.append(time.perf_counter() - t0)

    p, d = figures[PRISTINE]["tok_s"], figures["patched"]["tok_s"]
    ratio = statistics.median(d) / statistics.median(p)
    per_round = [b / a for a, b in zip(p, d)]
    print(
        f"SGLang {args.version}, target {model_dir if args.model_dir else args.profile + ' tiny target'} "
        f"(hidden {hidden}, {layers} layers, aux {aux}), torch threads per server: SGLang's choice"
    )
    print(
        f"{args.rounds} rounds (A C B, B C A, ...) of {args.requests} prefills x {args.tokens} tokens = {tokens} tokens"
    )
    for side in sides:
        f = figures[side]
        print(
            f"{side}: {median_range(f['tok_s'])} tok/s; server CPU s/round {median_range(f['server_cpu_s'], '{:.2f}')}"
            f", driver CPU s/round {median_range(f['driver_cpu_s'], '{:.2f}')}"
            f", the other (idle) server's CPU s meanwhile {median_range(f['idle_server_cpu_s'], '{:.2f}')}"
        )
    print(
        f"ratio of medians patched / pristine = {ratio:.3f} (goal >= 0.90); per round "
        f"{median_range(per_round, '{:.3f}')}; of each side's fastest round {max(d) / max(p):.3f} (on a shared "
        f"machine the least disturbed)"
    )
    print("rounds (tok/s): " + "; ".join(f"{a:,.0f} / {b:,.0f}" for a, b in zip(p, d)) + " (pristine / patched)")
    r = figures[REQUESTS]["tok_s"]
    print(
        f"where the patched side's time goes: requests to the dumping server / pristine "
        f"{statistics.median(r) / statistics.median(p):.3f} (the server's hook and writer), patched / requests only "
        f"{statistics.median(d) / statistics.median(r):.3f} (the driver: waiting for, reading and stitching the chunk "
        f"files, committing the shard)"
    )
    overhead = statistics.median(probe) / (tokens / statistics.median(p))
    print(
        f"a round of {args.requests} 1-token prefills on the pristine server: {median_range(probe, '{:.3f}')} s, "
        f"{overhead:.0%} of a pristine round's median"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "version": args.version,
                    "hidden": hidden,
                    "layers": layers,
                    "requests": args.requests,
                    "tokens": args.tokens,
                    "figures": figures,
                    "ratio_of_medians": ratio,
                    "one_token_round_s": probe,
                    "loadavg": os.getloadavg(),
                },
                indent=1,
            )
        )


def _remove_chunks(dump_dir: Path) -> None:
    deadline = time.monotonic() + 60  # the writer thread may still be writing the last ones
    while time.monotonic() < deadline and len(list(dump_dir.glob("*.safetensors"))) < 1:
        time.sleep(0.05)
    time.sleep(0.5)
    for f in dump_dir.glob("*.safetensors"):
        f.unlink()


def _extract(base_url: str, dump_dir: Path, merged: Path, version_dir: Path, aux: list[int], hidden: int) -> None:
    """The patched side: the shard through the driver, as the hidden_states stage runs it on the GPU host."""
    (spec,) = plan_shards(merged, 10**9)
    result = extract_shard_sglang(
        DriverSettings(base_url, dump_dir, concurrency=spec.num_records),
        merged,
        spec,
        version_dir,
        aux_layers=aux,
        hidden_size=hidden,
        dtype="bfloat16",
        target_identity="bench",
    )
    assert result.num_tokens == spec.num_tokens and not result.skipped, result


if __name__ == "__main__":
    main()
