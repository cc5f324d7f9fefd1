"""Two GPU hosts on one machine (a 16-GPU box as two TP=8 hosts, or the production rehearsal's two sshd hosts on
loopback) cannot both serve on hidden.sglang_port: each host may name its own port, which extraction and the
served benchmark launch on."""

from __future__ import annotations

import pytest

from eagle3_dagster.config import load_profile
from eagle3_dagster.host_config import HostConfig
from eagle3_dagster.stages.bench import BenchSettings


def test_a_host_serves_on_its_own_port_or_the_profiles():
    assert HostConfig(sglang_port=31001).server_port(30000) == 31001
    assert HostConfig().server_port(30000) == 30000
    with pytest.raises(ValueError, match="sglang_port"):
        HostConfig(sglang_port=70000)


def test_the_profile_takes_a_port_per_host():
    hosts = [{"name": "a", "sglang_port": 31001}, {"name": "b", "sglang_port": 31002}]
    profile = load_profile("micro", overrides={"gpu_host": {"hosts": hosts}})
    assert [h.server_port(profile.hidden.sglang_port) for h in profile.gpu_host.hosts] == [31001, 31002]


def test_the_served_benchmark_launches_on_the_hosts_port(tmp_path):
    from eagle3_dagster.stages.bench import serving_spec

    profile = load_profile("micro")
    assert serving_spec(BenchSettings.from_profile(profile), tmp_path, tmp_path, None, None, port=31002).port == 31002
    assert (
        serving_spec(BenchSettings.from_profile(profile), tmp_path, tmp_path, None, None).port
        == profile.hidden.sglang_port
    )
