"""benchmarks/drafter_quality.py: a variant's name means one recipe whatever the profile's default is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from eagle3_dagster.config import load_profile

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("drafter_quality", ROOT / "benchmarks" / "drafter_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_named_variants_train_the_drafter_they_name_when_the_profile_trains_eagle31():
    bench, demo = _bench(), load_profile("demo")
    assert demo.drafter.fc_norm and demo.drafter.norm_output  # the demo trains EAGLE 3.1 by default
    plain = bench.variant_profile(demo, bench.VARIANTS["one_sample_6ep"], seed=1)
    assert (plain.drafter.fc_norm, plain.drafter.norm_output) == (False, False)
    assert plain.train.seed == 1 and plain.train.epochs == 6 and tuple(plain.train.betas) == (0.9, 0.999)
    e31 = bench.variant_profile(demo, bench.VARIANTS["one_sample_6ep_eagle31_b95"], seed=0)
    assert (e31.drafter.fc_norm, e31.drafter.norm_output) == (True, True) and tuple(e31.train.betas) == (0.9, 0.95)
    as_is = bench.variant_profile(demo, bench.VARIANTS["profile"], seed=0)
    assert as_is.drafter == demo.drafter and as_is.train.epochs == demo.train.epochs
