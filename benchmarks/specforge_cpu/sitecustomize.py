"""SpecForge 0.2.0's KL loss on a torch without CUDA: its own reference formula instead of its Triton kernel.

`specforge/core/loss.py` imports `triton` at the top and computes the EAGLE-3 KL loss (`LogSoftmaxLoss`, called by
`algorithms/eagle3/model.py`) with two Triton kernels, which exist only on a GPU; the project's CPU torch has no
Triton, so the trainer stops at import. The same file keeps the reference its kernels implement (`_compute_loss`:
`-sum(position_mask * target_p * log_softmax(logits.float()), -1).mean()` over every position, a masked position
counting zero), and that is what stands in for `specforge.core.loss` here, with autograd's gradient for the kernel's
hand-written backward. Nothing else of SpecForge changes: its training loop, model and data path run as released.

Imported by Python at start-up (`site`) in every process of a SpecForge run whose environment puts this folder on
`PYTHONPATH` (benchmarks/specforge_variant.py only). A torch with CUDA keeps SpecForge's own module.
"""

import sys
import types

import torch

if not torch.cuda.is_available():

    class LogSoftmaxLoss:
        """`LogSoftmaxLoss.apply(logits [B,T,V], target_p [B,T,V], position_mask [B,T,1])`: the mean over B*T
        positions of -sum(target_p * log_softmax(logits)), masked positions counting zero."""

        @staticmethod
        def apply(logits, target, position_mask):
            logp = torch.nn.functional.log_softmax(logits.float(), dim=2)
            return -torch.sum(position_mask * target * logp, 2).mean()

    _loss = types.ModuleType("specforge.core.loss", "SpecForge's EAGLE-3 KL loss, the reference formula (CPU).")
    _loss.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = _loss
