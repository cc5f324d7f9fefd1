"""The description of one GPU host: where its commands run and with which interpreter.

The only one: the profile lists hosts (`gpu_host.hosts` in config.py), the engine's `GpuHost`
(gpu_host.py) runs commands on one, and the Dagster resource's config is this class made a
`dg.Config` (resources/gpu_host.py), so the fields and their help are written here only. A leaf
module, so that config.py and gpu_host.py both import it without importing each other.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HostConfig(BaseModel):
    """One GPU host: where its commands run and with which interpreter."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the profile (config._Strict)

    transport: Literal["local", "ssh"] = Field("local", description="run GPU commands here or over ssh")
    ssh_target: str | None = Field(None, description="user@host for transport=ssh")
    ssh_options: list[str] = Field(default_factory=list, description="extra ssh arguments, e.g. -p 2222")
    python: str = Field(
        "python",
        description="the interpreter on the host (SGLang's environment); on a local "
        "host the default, python, is the interpreter running the pipeline",
    )
    workdir: str = Field(".eagle3/gpu_host", description="working folder on the host (pid files, logs)")
    num_gpus: int = Field(
        0,
        ge=0,
        le=1024,
        json_schema_extra={"bounds": "more GPUs than one host has"},
        description="GPUs the preflight expects on the host",
    )  # bounds: as config._bounded
    name: str | None = Field(
        None,
        description="the host's name in leases, run tags and logs; default: 'local' or "
        "the ssh target (required when two hosts would get the same name)",
    )
    sglang_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        json_schema_extra={"bounds": "TCP ports are 1-65535"},
        description="this host's SGLang port when it is not hidden.sglang_port: two "
        "hosts on one machine (a 16-GPU box as two TP=8 hosts) need two ports",
    )

    def server_port(self, default: int) -> int:
        """The port this host's SGLang server listens on: its own, or the profile's `hidden.sglang_port`."""
        return self.sglang_port if self.sglang_port is not None else default

    @model_validator(mode="after")
    def _target_for_ssh(self) -> HostConfig:
        if self.transport == "ssh" and not self.ssh_target:
            raise ValueError("ssh_target is required for transport 'ssh'")
        return self

    @property
    def label(self) -> str:
        return self.name or (self.ssh_target if self.transport == "ssh" and self.ssh_target else "local")
