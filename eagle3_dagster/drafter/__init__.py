"""The EAGLE-3 drafter: model (model.py), training-time-test attention (ttt.py), loss and metrics
(loss.py), the target tensors it borrows (target_head.py) and the SGLang/vLLM export (export.py)."""

from eagle3_dagster.drafter.imported import load_drafter
from eagle3_dagster.drafter.model import DraftKVCache, DrafterConfig, Eagle3Drafter

__all__ = ["DraftKVCache", "DrafterConfig", "Eagle3Drafter", "load_drafter"]
