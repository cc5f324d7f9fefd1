"""Errors a user can act on when the object store misbehaves: range reads retried within a bound, then an
error naming the object and the cause. A real S3 server (moto, on loopback) behind a TCP proxy that can
refuse connections for a while, reached through s3fs as in production."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_dagster import storage
from eagle3_dagster.hidden.ranged import RangedSafetensors


class FaultProxy:
    """TCP on loopback forwarding to `target`; while `refusing` > 0 each new connection is closed at once
    (and `refusing` counts down), as a store that drops connections does."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.refusing = target, 0
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
            if refuse:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()  # a reset: the request never reached the store
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
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


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A bucket on a moto server reached through a FaultProxy; botocore's own retries off, so the test
    sees this project's bound."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = FaultProxy(server.get_host_and_port())
    for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(storage, "READ_BACKOFF_S", 0.01)
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
    assert url in message and f"after {storage.READ_ATTEMPTS} tries" in message
    assert "Error" in message.split("): ", 1)[1]  # the cause, by its type
    assert "testing" not in message  # no credential
