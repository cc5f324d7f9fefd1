"""`torch.cuda.synchronize()` as SGLang's own CPU platform synchronizes: not at all, on a torch without CUDA.

SGLang 0.5.23's MLA drafter class (`sglang/srt/models/kimi_k25_eagle3.py`, `Eagle3DeepseekV2ForCausalLM.set_embed`
and `set_embed_and_head`, lines 414 and 422) calls `torch.cuda.synchronize()` directly when the EAGLE worker hands it
the target's embeddings at start-up, where the GQA drafter's (`llama.py:905`, `:924`) calls
`current_platform.synchronize()`, which is nothing on CPU. On the tier's CPU torch that call raises
`AssertionError: Torch not compiled with CUDA enabled` and the server stops before it is healthy. Nothing else
changes: a torch with CUDA keeps its own.

Imported by Python at start-up (`site`) in every process of a server whose environment puts this folder on
`PYTHONPATH` (`venv.server_env(python, cuda_sync=True)`: test_real_eagle3_mla.py only); the venv has no
sitecustomize of its own.
"""

import torch

if not torch.cuda.is_available():

    def _synchronize(device=None) -> None:
        """No device to wait for: CPU work is done when the call returns."""

    torch.cuda.synchronize = _synchronize
