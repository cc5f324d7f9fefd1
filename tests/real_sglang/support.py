"""What the real-SGLang tests share: the release, a free port, and the comparison with transformers.

Tolerance: SGLang computes in its own kernels and dtype (bfloat16 for a float32 checkpoint), so its
states cannot equal transformers' float32 ones bit for bit. The envelope is measured in each test:
transformers in bfloat16 against transformers in float32, per tensor (each aux layer, the last state),
as the median and the maximum over tokens of the per-token relative L2 error. SGLang against float32
must stay within ENVELOPE_FACTOR times that envelope.
"""

from __future__ import annotations

import functools
import socket
from pathlib import Path

import torch

VERSION = "0.5.23"
AUX = (1, 2, 3)  # the micro profile's canonical aux layers (HF output_hidden_states indices)
ENVELOPE_FACTOR = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 error [T]."""
    return (x.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)


def hf_states(model_dir: Path, dtype: torch.dtype, ids: list[int]) -> list[torch.Tensor]:
    """transformers' output_hidden_states (L+1 states, the last after the final norm), as float32 [T, H]."""
    model = _model(str(model_dir), dtype)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return [h[0].float() for h in out.hidden_states]


@functools.cache
def _model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
