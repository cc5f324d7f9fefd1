"""`load_tokenizer` reads the model directory and nothing else: a tokenizer config whose `auto_map` names a hub
repository's code is refused without a request to the hub. The hub is a real HTTP server on loopback that
records what it is asked (HF_ENDPOINT), in a process with the offline switches the tests set turned off, as a
Dagster run has them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.loopback_http import LoopbackHTTPServer

ROOT = Path(__file__).resolve().parents[2]
HUB_REPO = "evil-org/evil-repo"


class _Hub(LoopbackHTTPServer):
    """Answers 404 to everything, recording each request line."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        super().__init__()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _any(self) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_POST = _any

        return Handler


def _tokenizer_dir(path: Path, auto_map: dict | None = None, code: str | None = None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    if auto_map is not None:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps(cfg | {"auto_map": auto_map}))
    if code is not None:
        (path / "tokenization_local.py").write_text(code)
    return path


def _load_online(model_dir: Path, hf_home: Path, hub: _Hub) -> subprocess.CompletedProcess:
    """load_tokenizer(model_dir, trust_remote_code=True) in a process that may reach the (loopback) hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_ENDPOINT": hub.url.removesuffix("/v1"), "HF_HOME": str(hf_home), "PYTHONPATH": str(ROOT)}
    script = textwrap.dedent(f"""
        from eagle3_dagster.target import load_tokenizer
        tok = load_tokenizer({str(model_dir)!r}, trust_remote_code=True)
        print(type(tok).__name__, tok.encode("hello world", add_special_tokens=False))
    """)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_an_auto_map_naming_a_hub_repository_is_refused_without_asking_the_hub(tmp_path):
    model_dir = _tokenizer_dir(tmp_path / "target", {"AutoTokenizer": [f"{HUB_REPO}--tokenization_evil.Evil", None]})
    with _Hub() as hub:
        run = _load_online(model_dir, tmp_path / "hf", hub)
    assert not [r for r in hub.requests if HUB_REPO in r], hub.requests
    assert run.returncode != 0
    assert f"tokenizer_config.json auto_map.AutoTokenizer: {HUB_REPO}" in run.stderr and "never fetched" in run.stderr


def test_a_tokenizer_with_its_own_code_in_the_directory_still_loads_offline(tmp_path):
    code = textwrap.dedent("""
        from transformers import PreTrainedTokenizerFast

        class LocalTokenizer(PreTrainedTokenizerFast):
            pass
    """)
    model_dir = _tokenizer_dir(
        tmp_path / "target", {"AutoTokenizer": [None, "tokenization_local.LocalTokenizer"]}, code
    )
    with _Hub() as hub:
        run = _load_online(model_dir, tmp_path / "hf", hub)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "LocalTokenizer" and "[1, 2]" in run.stdout
    assert not [r for r in hub.requests if "/resolve/" in r or "/api/models" in r], hub.requests


@pytest.mark.parametrize("trust", [True, False])
def test_a_plain_tokenizer_loads_from_its_directory(tmp_path, trust):
    from eagle3_dagster.target import load_tokenizer

    tok = load_tokenizer(_tokenizer_dir(tmp_path / "target"), trust_remote_code=trust)
    assert tok.encode("hello world", add_special_tokens=False) == [1, 2]
