"""The API key: stripped and checked when read, and in no form (raw, escaped, repr, JSON) in logs, metadata,
exceptions or files, also when it arrives with whitespace or control characters. Real HTTP server on loopback."""

from __future__ import annotations

import json
import logging

import pytest

from eagle3_dagster.data.sharegpt import Conversation
from eagle3_dagster.generate.client import ChatRequestError, OpenAIChatBackend
from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync
from resources.chat_api import ChatApiResource
from test_chat_client import FakeOpenRouter

CORE = "sk-or-v1-0123456789abcdef"
SETTINGS = GenerationSettings(model="m", max_new_tokens=16, concurrency=1, max_failure_fraction=1.0)


def forms(key: str) -> set[str]:
    """Every way a key shows up when printed: as is, stripped, escaped (h11, bytes repr), repr, JSON."""
    out = {
        key,
        key.strip(),
        repr(key)[1:-1],
        json.dumps(key)[1:-1],
        str(key.encode())[2:-1],
        key.encode("unicode_escape").decode(),
    }
    return {f for f in out if f}


def _convs(n: int) -> list[Conversation]:
    return [
        Conversation(id=f"c{i}", messages=({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": ""}))
        for i in range(n)
    ]


@pytest.mark.parametrize("raw", [CORE + "\n", "  " + CORE + "\t", CORE + "\r\n"], ids=["newline", "spaces_tab", "crlf"])
def test_surrounding_whitespace_is_stripped_and_no_form_of_the_key_is_ever_written(tmp_path, caplog, raw):
    caplog.set_level(logging.DEBUG)
    store = tmp_path / "raw.jsonl"
    key = ChatApiResource(api_key=raw).key()
    assert key == CORE
    with FakeOpenRouter(["echo_key", "500"]) as server:
        backend = OpenAIChatBackend(server.url, "m", raw, backoff_initial_s=0.01, backoff_max_s=0.02, max_retries=0)
        stats = regenerate_dataset_sync(_convs(3), store, backend, SETTINGS, dataset="ds")
    assert stats.num_successes == 1 and stats.failures_by_kind == {"client_error": 1, "server_error": 1}
    written = caplog.text + store.read_text() + json.dumps(stats.as_dict()) + repr(backend)
    for form in forms(raw) | forms(CORE):
        assert form not in written


@pytest.mark.parametrize(
    "raw",
    [CORE[:10] + "\n" + CORE[10:], CORE[:5] + "\x00" + CORE[5:], CORE + " x", CORE[:8] + "\x1b[0m" + CORE[8:]],
    ids=["inner_newline", "nul", "inner_space", "ansi"],
)
def test_a_key_with_inner_whitespace_or_control_characters_is_refused_without_showing_it(caplog, raw):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ValueError) as resource_err:
        ChatApiResource(api_key=raw).key()
    with pytest.raises(ValueError) as backend_err:
        OpenAIChatBackend("http://127.0.0.1:9/v1", "m", raw)
    for err in (resource_err.value, backend_err.value):
        text = str(err) + repr(err) + caplog.text
        assert "API key" in str(err) and "whitespace or control character" in str(err)
        for form in forms(raw):
            assert form not in text
        for piece in (CORE[:10], CORE[10:]):  # not even the halves around the bad character
            assert piece not in text


def test_a_server_echoing_the_key_in_escaped_form_is_scrubbed(tmp_path):
    # a key with characters that escaping changes: the server echoes it JSON-escaped, not as sent
    key = 'sk-"quoted"\\back'
    with FakeOpenRouter(["echo_key"]) as server:
        backend = OpenAIChatBackend(server.url, "m", key, max_retries=0)
        with pytest.raises(ChatRequestError) as err:
            import asyncio

            async def go():
                try:
                    await backend.complete(
                        [{"role": "user", "content": "hi"}],
                        request_id="r",
                        max_tokens=4,
                        temperature=0.0,
                        reasoning=False,
                    )
                finally:
                    await backend.aclose()

            asyncio.run(go())
    text = str(err.value) + repr(err.value)
    assert "***" in text
    for form in forms(key):
        assert form not in text


def _model_with_code(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["tok.CodeTokenizer", null]}, "tokenizer_class": "CodeTokenizer"}'
    )
    ran = tmp_path / "code_ran"
    (model / "tok.py").write_text(
        f"open({str(ran)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizer\n"
        "class CodeTokenizer(PreTrainedTokenizer):\n    pass\n"
    )
    return model, ran


def test_code_shipped_with_an_external_target_runs_only_when_the_profile_says_so(tmp_path):
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.stages.data import _tokenizer
    from eagle3_dagster.stages import TargetFiles

    model, ran = _model_with_code(tmp_path)
    profile = load_profile("micro", overrides={"target": {"kind": "external", "path": str(model)}})
    assert profile.target.trust_remote_code is False
    with pytest.raises(ValueError, match="target.trust_remote_code"):
        _tokenizer(TargetFiles.from_profile(profile), ArtifactLayout.from_profile(profile))
    assert not ran.exists()


def test_a_tokenizer_whose_shipped_code_imports_a_missing_package_is_an_error_naming_the_package(tmp_path):
    """Kimi-K2.5's tokenization_kimi.py imports tiktoken: a host without it gets the package's name, not a
    bare ImportError from deep inside transformers."""
    from eagle3_dagster.target import load_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}, '
        '"tokenizer_class": "TikTokenTokenizer"}'
    )
    (model / "tokenization_kimi.py").write_text(
        "import eagle3_missing_bpe_package\n"
        "from transformers import PreTrainedTokenizer\n"
        "class TikTokenTokenizer(PreTrainedTokenizer):\n    pass\n"
    )
    with pytest.raises(ValueError, match=r"eagle3_missing_bpe_package.*pip install"):
        load_tokenizer(model, trust_remote_code=True)
