"""What a profile may not say, refused when it loads (naming `section.field`) rather than found out later:
credentials in any URL (a profile is published in run metadata and logs), combinations that could only fail
after training, and locations that name no folder of their own."""

from __future__ import annotations

import re

import pytest

from eagle3_dagster.config import ProfileError, load_profile

SECRET = "hunter2SECRET"
OPENAI = {"backend": "openai", "model": "moonshotai/kimi-k2.5"}

CREDENTIAL_URLS = {
    "userinfo": f"https://alice:{SECRET}@openrouter.ai/api/v1",
    "user_only": f"https://{SECRET}@openrouter.ai/api/v1",
    "api_key": f"https://openrouter.ai/api/v1?api_key={SECRET}",
    "token": f"http://gpu-host:30000/v1?x=1&token={SECRET}",
    "key": f"https://generativelanguage.example/v1?key={SECRET}",
    "access_token": f"https://host/v1?access_token={SECRET}",
}


@pytest.mark.parametrize("url", CREDENTIAL_URLS.values(), ids=CREDENTIAL_URLS.keys())
def test_a_base_url_carrying_a_credential_is_refused_naming_the_field_and_not_the_secret(url):
    with pytest.raises(ProfileError, match=r"\bgeneration\.base_url: the URL carries a credential") as e:
        load_profile("micro", overrides={"generation": {**OPENAI, "base_url": url}})
    assert SECRET not in str(e.value) and "alice" not in str(e.value)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"hidden": {"root": f"s3://bucket/hidden?token={SECRET}"}}, "hidden.root"),
        # an AWS secret key with a '/' in it: URL parsers read the password as the start of the path
        ({"hidden": {"root": f"s3://AKIAEXAMPLE:wJalr/{SECRET}@bucket/hidden"}}, "hidden.root"),
        ({"train": {"export_location": f"gs://bucket/drafters?X-Goog-Credential={SECRET}"}}, "train.export_location"),
        (
            {"datasets": [{"name": "d", "source": "prompts_jsonl", "path": f"https://host/d.jsonl?sig={SECRET}"}]},
            "datasets[0].path",
        ),
        ({"bench": {"set_paths": {"tool_use": f"https://u:{SECRET}@host/tool_use.jsonl"}}}, "bench.set_paths.tool_use"),
    ],
)
def test_every_url_field_of_the_profile_refuses_credentials(overrides, field):
    # a location field is refused by storage.location, a URL field by the profile's check: both name the field
    with pytest.raises(
        ProfileError, match=rf"{re.escape(field)}: (Value error, a \w+:// location|the URL) carries a credential"
    ) as e:
        load_profile("micro", overrides=overrides)
    assert SECRET not in str(e.value)


@pytest.mark.parametrize(
    "url",
    [
        "https://openrouter.ai/api/v1",
        "http://127.0.0.1:30000/v1",
        "s3://bucket/prefix",
        "hf://datasets/org/x@main/a",
        "https://host/v1?model=kimi&keep_alive=1",
        "/data/run",
        "user@host",
    ],
)
def test_a_url_without_credentials_is_not_a_credential(url):
    from eagle3_dagster.url_secrets import url_credentials

    assert url_credentials(url) is None


def test_eagle31_options_with_aux_layers_no_eagle31_release_captures_are_refused_when_the_profile_loads():
    """micro's aux layers [1, 2, 3]: 0.5.12 captures them from ids [0, 1, 2], the releases after it from no draft
    config; the export (after training) writes ids for all of them when fc_norm / norm_output is on."""
    for options in ({"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}):
        with pytest.raises(ProfileError, match=r"hidden\.aux_layers: .*drafter\.(fc_norm|norm_output)"):
            load_profile("micro", overrides={"drafter": options})
    # a release named that captures them and reads the options: loads
    assert load_profile("micro", overrides={"drafter": {"fc_norm": True}, "gpu_host": {"sglang_version": "0.5.12"}})
    # aux layers starting at 2 are right on every release: loads
    assert load_profile("micro", overrides={"drafter": {"fc_norm": True}, "hidden": {"aux_layers": [2, 3, 4]}})


def test_the_refused_combination_is_the_one_the_export_refuses_after_training():
    import torch

    from eagle3_dagster.drafter.export import export_config
    from eagle3_dagster.drafter.model import DrafterConfig

    def cfg(aux_layers, **options):
        return DrafterConfig(
            target_hidden_size=8,
            hidden_size=8,
            intermediate_size=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            vocab_size=64,
            draft_vocab_size=32,
            aux_layers=aux_layers,
            **options,
        )

    with pytest.raises(ValueError, match="no draft config makes SGLang"):
        export_config(cfg((1, 2, 3), fc_norm=True), 512, torch.bfloat16)
    assert export_config(cfg((1, 2, 3)), 512, torch.bfloat16)  # without the options: exported, and loads
    assert export_config(cfg((2, 3, 4), fc_norm=True), 512, torch.bfloat16)


@pytest.mark.parametrize("lk", [{"lk_kl_scale": 0.5}, {"lk_kl_decay": 2.0}, {"lk_kl_scale": 1.0, "lk_kl_decay": 1.0}])
def test_lk_lambda_settings_with_the_kl_loss_are_refused_naming_them(lk):
    with pytest.raises(ProfileError, match=r"train\.lk_kl_(scale|decay).*train\.loss: lk_lambda") as e:
        load_profile("micro", overrides={"train": lk})
    assert all(f"train.{k}" in str(e.value) for k in lk)
    assert load_profile("micro", overrides={"train": {**lk, "loss": "lk_lambda"}}).train.loss == "lk_lambda"


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"hidden": {"root": "/"}}, "hidden.root"),
        ({"hidden": {"root": "file:///"}}, "hidden.root"),
        ({"hidden": {"root": "/data/.."}}, "hidden.root"),
        ({"hidden": {"root": ""}}, "hidden.root"),
        ({"run_root": ""}, "run_root"),
        ({"run_root": "/"}, "run_root"),
        ({"run_root": "  "}, "run_root"),
        ({"train": {"export_location": "/"}}, "train.export_location"),
        ({"hidden": {"staging_dir": ""}}, "hidden.staging_dir"),
    ],
)
def test_a_location_that_names_no_folder_of_its_own_is_refused(overrides, field):
    with pytest.raises(ProfileError, match=rf"\n  {re.escape(field)}: .*(empty|file system's root)"):
        load_profile("micro", overrides=overrides)


def test_every_checked_in_profile_still_loads():
    from eagle3_dagster.config import CONFIG_DIR

    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        assert load_profile(str(path)).profile == path.stem


@pytest.mark.parametrize("url", CREDENTIAL_URLS.values(), ids=CREDENTIAL_URLS.keys())
def test_the_chat_backend_repr_shows_no_credential_of_a_base_url_built_in_code(url):
    from eagle3_dagster.generate.client import OpenAIChatBackend

    shown = repr(OpenAIChatBackend(url, "m", "sk-key"))
    assert SECRET not in shown and "alice" not in shown and "sk-key" not in shown
    assert "/v1" in shown  # the host and path are still shown
