"""An extraction server never runs with an option that would make a prefill skip rows or store other states.

A prefix served from a cache (radix, hierarchical, session, LMCache, a PD peer) is not recomputed and
has no hidden states; a mixed batch is not the plain EXTEND forward the hook dumps. Such options are
refused before anything starts, naming the option, both in the profile and in the launcher; the
release's own options always turn the radix cache off. On the real server: tests/real_sglang/.
"""

from __future__ import annotations

import pytest

from eagle3_dagster import sglang_releases
from eagle3_dagster.config import load_profile
from eagle3_dagster.sglang.server import ServerSpec
from eagle3_dagster.sglang_releases import EXTRACTION_REFUSED_OPTIONS

SKIPPING_ROWS = [
    "--enable-hierarchical-cache",
    "--enable-hicache",
    "--enable-session-radix-cache",
    "--radix-cache-backend=flexkv",
    "--enable-lmcache",
    "--enable-mixed-chunk",
    "--disaggregation-mode=prefill",
]


@pytest.mark.parametrize("option", SKIPPING_ROWS)
def test_the_launcher_refuses_an_option_that_skips_prefill_rows_naming_it(option):
    spec = ServerSpec(
        "/m", dump_dir="/d", dump_layers=(2, 30, 58), sglang_version="0.5.23", extra_args=("--device", "cpu", option)
    )
    with pytest.raises(ValueError, match=option.split("=")[0]):
        spec.argv("python")
    assert option.split("=")[0] in EXTRACTION_REFUSED_OPTIONS


@pytest.mark.parametrize("option", ["--enable-hierarchical-cache", "--enable-mixed-chunk"])
def test_the_profile_refuses_it_too_naming_the_field(option):
    with pytest.raises(Exception, match=f"hidden.sglang_server_args(.|\n)*{option}"):
        load_profile("micro", overrides={"hidden": {"sglang_server_args": ["--device", "cpu", option]}})


def test_every_release_turns_the_radix_cache_off_for_extraction():
    for version in sglang_releases.supported():
        argv = ServerSpec("/m", dump_dir="/d", dump_layers=(2, 30, 58), sglang_version=version).argv("python")
        assert "--disable-radix-cache" in argv, version


def test_a_cpu_device_gets_sglangs_cpu_engine_and_other_options_pass_through():
    spec = ServerSpec(
        "/m",
        dump_dir="/d",
        dump_layers=(1, 2, 3),
        sglang_version="0.5.23",
        extra_args=("--device", "cpu", "--attention-backend", "torch_native", "--chunked-prefill-size", "64"),
    )
    argv = spec.argv("python")
    assert argv[-6:] == ["--device", "cpu", "--attention-backend", "torch_native", "--chunked-prefill-size", "64"]
    assert spec.environment()["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "SGLANG_USE_CPU_ENGINE" not in ServerSpec("/m", dump_dir="/d", dump_layers=(1, 2, 3)).environment()


def test_a_serving_launch_forces_flashinfer_allreduce_fusion_off_on_every_release_that_has_the_option():
    """Releases 0.5.10-0.5.23 turn the fusion on by themselves for DeepSeek-V3 / Kimi-K2.5 on Hopper and
    Blackwell with TP > 1; SGLang's aux capture would then see per-rank partial sums at serve time, unlike
    the all-reduced states the drafter was trained on. The option is read from each release's sources."""
    for version, release in sglang_releases.supported().items():
        assert release.serving_args == ("--enforce-disable-flashinfer-allreduce-fusion",), version
        argv = ServerSpec("/m", tp_size=8, sglang_version=version).argv("python")
        assert "--enforce-disable-flashinfer-allreduce-fusion" in argv, version
        assert "--disable-radix-cache" not in argv, version  # a serving launch keeps the release's defaults
    assert "--enforce-disable-flashinfer-allreduce-fusion" not in ServerSpec("/m").argv("python")  # release unknown
