"""Errors a user can act on when the object store misbehaves: requests retried within the bound the profile's
`storage` settings give, then an error naming the object and the cause, with progress lines while a call
waits. A real S3 server (moto, on loopback) behind a TCP proxy that can refuse connections for a while or
accept them and never answer, reached through s3fs as in production."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from eagle3_dagster import storage
from eagle3_dagster.config import StorageConfig
from eagle3_dagster.hidden.ranged import RangedSafetensors


class FaultProxy:
    """TCP on loopback forwarding to `target`; while `refusing` > 0 each new connection is closed at once
    (and `refusing` counts down), as a store that drops connections does; while `hanging`, each new
    connection is accepted, its request read and never answered, as a hung store does."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.refusing, self.hanging = target, 0, False
        self.hung: list[socket.socket] = []
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                refuse = self.refusing != 0
                self.refusing -= refuse
            if self.hanging:
                self.hung.append(client)  # kept open, never answered: the client waits for its read timeout
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            if refuse:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()  # a reset: the request never reached the store
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _swallow(client: socket.socket) -> None:
        try:
            while client.recv(65536):
                pass
        except OSError:
            pass

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.hanging:  # a connection opened before the store hung hangs too
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for client in self.hung:
            client.close()


SETTINGS = StorageConfig(connect_timeout_s=1.0, read_timeout_s=1.0, attempts=3, progress_every_s=0.25)


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A bucket on a moto server reached through a FaultProxy, with the `storage` settings above (restored
    after the test)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = FaultProxy(server.get_host_and_port())
    for k, v in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(storage, "_settings", None)
    storage.configure(SETTINGS)
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()  # a new endpoint: no cached client of another test
    fs, _ = storage.filesystem("s3://faults")
    fs.makedirs("faults", exist_ok=True)  # moto keeps its buckets for the process
    local = tmp_path / "shard.safetensors"
    save_file({"x": torch.arange(12, dtype=torch.float32).view(6, 2)}, str(local))
    url = "s3://faults/v1/shard.safetensors"
    fs.put(str(local), url)
    yield url, local.stat().st_size, proxy
    proxy.close()
    server.stop()
    fsspec.filesystem("s3").clear_instance_cache()


def test_a_store_that_drops_a_few_connections_is_read_after_retries(store):
    url, size, proxy = store
    reader = RangedSafetensors(url, size)
    proxy.refusing = 2
    (rows,) = reader.rows([("x", 1, 3)])
    assert rows.tolist() == [[2.0, 3.0], [4.0, 5.0]] and proxy.refusing == 0


def test_a_store_that_keeps_failing_is_an_error_naming_the_object_and_the_cause(store):
    url, size, proxy = store
    reader = RangedSafetensors(url, size)
    proxy.refusing = -1  # for good
    with pytest.raises(storage.StoreReadError) as err:
        reader.rows([("x", 0, 2)])
    message = str(err.value)
    assert url in message and "bytes [" in message and "tried up to 3 times (storage.attempts)" in message
    assert "Error" in message.rsplit("): ", 1)[1]  # the cause, by its type
    assert "testing" not in message  # no credential


def _progress_lines(caplog, url: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "eagle3_dagster.storage"
        and r.getMessage().startswith(f"{url}: ")
        and "still in progress after" in r.getMessage()
    ]


def test_a_hung_store_fails_a_range_read_within_the_profiles_bound_naming_the_object_with_progress_lines(store, caplog):
    url, size, proxy = store
    reader = RangedSafetensors(url, size)
    proxy.hanging = True  # connections are accepted, requests read, nothing ever answered
    caplog.set_level(logging.WARNING, logger="eagle3_dagster.storage")
    started = time.monotonic()
    with pytest.raises(storage.StoreReadError) as err:
        reader.rows([("x", 0, 2)])
    waited = time.monotonic() - started
    # every try waited out its read timeout, and no more tries than storage.attempts were made (s3fs's own
    # 5 x 5 retries of a read would take 25 read timeouts)
    assert SETTINGS.attempts * SETTINGS.read_timeout_s <= waited <= storage.wait_bound_s(SETTINGS) < 30
    message = str(err.value)
    assert url in message and "ReadTimeoutError" in message and "storage.read_timeout_s" in message
    lines = _progress_lines(caplog, url)
    assert len(lines) >= 2 and "reading 1 byte range(s): still in progress after 0." in lines[0]


def test_a_store_call_begun_while_the_watcher_idles_gets_its_first_line_after_progress_every_s(monkeypatch, caplog):
    """The watcher thread idles between calls; a call begun then must not wait out the idle sleep (1 s) for its
    first line (the CI of stop 38 saw the first line after 1.0 s with progress_every_s 0.25). With lines every
    0.05 s, the old watcher's first line for the second call below came after ~0.9 s; the bound leaves 0.55 s for
    a loaded machine to schedule the thread."""
    every = 0.05
    monkeypatch.setattr(storage, "_settings", None)
    storage.configure(StorageConfig(connect_timeout_s=1.0, read_timeout_s=1.0, attempts=3, progress_every_s=every))
    waits = storage._Waits()
    caplog.set_level(logging.WARNING, logger="eagle3_dagster.storage")
    with waits.waiting("s3://idle/first"):
        pass  # starts the watcher, which finds nothing in flight at its first wake and idles
    time.sleep(2 * every)
    with waits.waiting("s3://idle/second"):
        time.sleep(1.2)
    lines = _progress_lines(caplog, "s3://idle/second")
    assert lines, "no line while the call waited 1.2 s"
    first = float(lines[0].split("still in progress after ", 1)[1].split(" s", 1)[0])
    assert first < 0.6, lines[:3]


def test_a_hung_store_fails_reading_a_manifest_within_the_bound_naming_it(store, caplog):
    url, _, proxy = store
    manifest = "s3://faults/v1/manifest.json"
    storage.location(manifest).write_json({"shard": 1})
    proxy.hanging = True
    caplog.set_level(logging.WARNING, logger="eagle3_dagster.storage")
    started = time.monotonic()
    with pytest.raises(storage.StoreError) as err:
        storage.read_json(manifest)
    assert time.monotonic() - started <= storage.wait_bound_s(SETTINGS)
    assert str(err.value).startswith(f"{manifest}: reading it failed (tried up to 3 times")
    assert "ReadTimeoutError" in str(err.value) and _progress_lines(caplog, manifest)


def test_the_profiles_storage_settings_reach_the_processes_a_run_starts(monkeypatch, tmp_path):
    from definitions import build_definitions
    from eagle3_dagster.config import load_profile

    monkeypatch.setattr(storage, "_settings", None)
    profile = load_profile("micro", overrides={"storage": {"read_timeout_s": 7, "attempts": 2}})
    build_definitions(profile)  # the code location and its run workers
    expected = storage.StorageSettings(**profile.storage.model_dump())
    assert storage.settings() == expected and storage.settings().read_timeout_s == 7
    child = subprocess.run(
        [sys.executable, "-c", "from eagle3_dagster import storage; print(repr(storage.settings()))"],
        capture_output=True,
        text=True,
        env={**os.environ, **storage.child_env()},
        check=True,
    )  # torchrun workers, drivers
    assert child.stdout.strip() == repr(expected)
