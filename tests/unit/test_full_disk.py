"""A full disk names the file being written and the space left (merge, regeneration, checkpointing), and
the temp files a killed writer leaves are removed by the next writer of the same file. The full disk is a
real one: a small tmpfs mounted for the test (skipped where this user may not mount)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest
import torch

from eagle3_dagster.data.merge import merge_and_shuffle
from eagle3_dagster.io import DiskFullError, write_jsonl


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _tokenized(path: Path, n: int, length: int = 200) -> Path:
    write_jsonl(
        path,
        (
            {
                "id": f"d/{i}",
                "dataset": "d",
                "input_ids": list(range(length)),
                "loss_mask": [0] * 10 + [1] * (length - 10),
            }
            for i in range(n)
        ),
    )
    return path


def test_merge_on_a_full_disk_names_the_output_and_the_free_space_and_leaves_no_temp(tmp_path, small_disk):
    source = _tokenized(tmp_path / "d.jsonl", 400)  # about 0.8 MB of records for a 256 KiB disk
    out = small_disk / "merged_train.jsonl"
    with pytest.raises(DiskFullError) as err:
        merge_and_shuffle({"d": source}, out, max_seq_len=8192, seed=0)
    assert str(out) in str(err.value) and "MiB free in" in str(err.value)
    assert list(small_disk.iterdir()) == []  # the partial temp file is gone


def test_regeneration_on_a_full_disk_names_the_request_log_and_sends_nothing(tmp_path, small_disk):
    from eagle3_dagster.contracts import Conversation
    from eagle3_dagster.generate.client import OpenAIChatBackend
    from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync
    from test_chat_client import SECRET, FakeOpenRouter

    store = small_disk / "raw.jsonl"
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk up to the last byte
        while os.write(fd, b"\0" * 512):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    convs = [Conversation(id="c0", messages=({"role": "user", "content": "q"}, {"role": "assistant", "content": ""}))]
    with FakeOpenRouter() as server:
        with pytest.raises(DiskFullError) as err:
            regenerate_dataset_sync(
                convs,
                store,
                OpenAIChatBackend(server.url, "m", SECRET, timeout_s=5),
                GenerationSettings(model="m"),
                dataset="ds",
            )
        assert server.received == []  # the `sent` line comes first; it could not be written
    assert str(store) in str(err.value) and "MiB free in" in str(err.value)


def test_a_checkpoint_on_a_full_disk_names_the_file_and_the_free_space(small_disk):
    from eagle3_dagster.train.checkpoint import Checkpointer

    weight = torch.nn.Parameter(torch.zeros(100_000))  # 400 kB of weights for a 256 KiB disk
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    with pytest.raises(DiskFullError) as err:
        Checkpointer(small_disk / "ckpt", every=1, rank=0).save(
            1, model_state={"w": weight}, optimizer=optimizer, scheduler=scheduler, trainer_state={}
        )
    assert "model.safetensors" in str(err.value) and "MiB free in" in str(err.value)
    assert "basic_ios" not in str(err.value).split("MiB free in")[0]


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from eagle3_dagster.io import atomic_open
    with atomic_open(sys.argv[1]) as f:
        f.write(b"x" * 1_000_000)
        f.flush()
        print("writing", flush=True)
        time.sleep(600)
""")


def test_the_temp_file_of_a_killed_merge_is_removed_by_the_next_merge(tmp_path):
    out = tmp_path / "merged_train.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout.readline().strip() == "writing"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    left = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and (tmp_path / left[0]).stat().st_size == 1_000_000

    live = tmp_path / f".merged_train.jsonl.{os.uname().nodename}-{os.getpid()}.keep.tmp"
    live.write_bytes(b"a live writer's")  # this process is alive: its temp file stays
    stats = merge_and_shuffle({"d": _tokenized(tmp_path / "d.jsonl", 3)}, out, max_seq_len=8192, seed=0)
    assert stats.num_records == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == [live.name]
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()].count("d/0") == 1
