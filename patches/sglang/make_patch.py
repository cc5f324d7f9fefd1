"""Maintainer tool: render the hidden-state dump patch for one pristine deepseek_v2.py.

Usage (from the repo root, after `python -m tests.sglang_wheels 0.5.X` cached the wheel):

    python patches/sglang/make_patch.py <pristine deepseek_v2.py> <style: loop|collector> > out.patch

The checked-in `.patch` files are the source of truth that `eagle3_dagster.sglang.patch`
applies; this script only exists so that supporting a new SGLang release is a
reviewed, reproducible step rather than a hand-edited diff. It anchors on source
lines and fails loudly when an anchor is missing or ambiguous, which is exactly
the signal that a new release moved the code and needs reading.

Two styles, matching how SGLang captures aux states (DESIGN §3):
- loop (<= 0.5.13): the layer loop still holds `hidden_states` and `residual`, so the
  hook is called at the top of each iteration with both and sums them itself.
- collector (>= 0.5.14): the sum only exists inside the decoder layer, which hands
  it to a `captured_last_layer_outputs` collector; the patch passes the hook's
  collector there (teeing into SGLang's own one when EAGLE-3 also captures that layer).
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

GUARD = '''# eagle3-dagster: hidden-state dump for EAGLE-3 training (see eagle3_dagster/sglang/dump_hook.py).
# Inert unless SGLANG_HS_DUMP_DIR is set when this module is imported.
if __import__("os").environ.get("SGLANG_HS_DUMP_DIR"):
    from eagle3_dagster.sglang import dump_hook as _eagle3_hs_dump
else:
    _eagle3_hs_dump = None


'''

LOOP_CALL = (
    "{ind}if _eagle3_hs_dump is not None:\n"
    "{ind}    _eagle3_hs_dump.capture_layer_input(i, hidden_states, residual, forward_batch)\n"
)
FINAL_CALL = (
    "        if _eagle3_hs_dump is not None:\n"
    "            _eagle3_hs_dump.capture_final(hidden_states, input_ids, forward_batch)\n"
)
COLLECTOR_ARG = (
    "                    captured_last_layer_outputs=_eagle3_hs_dump.layer_collector(\n"
    "                        i,\n"
    "                        forward_batch,\n"
    "                        aux_hidden_states if i in self.layers_to_capture else None,\n"
    "                    )\n"
    "                    if _eagle3_hs_dump is not None\n"
    "                    else (aux_hidden_states if i in self.layers_to_capture else None),\n"
)


def _find_one(lines: list[str], start: int, predicate, what: str) -> int:
    hits = [k for k in range(start, len(lines)) if predicate(lines[k])]
    if len(hits) != 1:
        raise SystemExit(f"anchor {what!r}: expected exactly 1 match after line {start + 1}, found {len(hits)}")
    return hits[0]


def _first(lines: list[str], start: int, predicate, what: str) -> int:
    for k in range(start, len(lines)):
        if predicate(lines[k]):
            return k
    raise SystemExit(f"anchor {what!r} not found after line {start + 1}")


def render(text: str, style: str) -> str:
    lines = text.splitlines(keepends=True)
    cls = _find_one(lines, 0, lambda s: s.startswith("class DeepseekV2Model("), "class DeepseekV2Model")
    fwd = _first(lines, cls, lambda s: s.startswith("    def forward("), "DeepseekV2Model.forward")
    end = _first(lines, fwd + 1, lambda s: s.startswith("class "), "next class")
    loop = _first(lines, fwd, lambda s: s.strip() == "for i in range(normal_start_layer, normal_end_layer):", "loop")
    final = _find_one(lines[:end], fwd, lambda s: s == "        if len(aux_hidden_states) == 0:\n", "return")
    edits: list[tuple[int, int, str]] = [(cls, cls, GUARD), (final, final, FINAL_CALL)]
    if style == "loop":
        call = _first(lines, loop, lambda s: s.strip() == "layer = self.layers[i]", "layer = self.layers[i]")
        ind = " " * (len(lines[call]) - len(lines[call].lstrip()))
        edits.append((call, call, LOOP_CALL.format(ind=ind)))
    elif style == "collector":
        arg = _find_one(lines[:end], loop, lambda s: s.strip().startswith("captured_last_layer_outputs="), "capture arg")
        stop = arg
        while not lines[stop].rstrip().endswith(","):  # the argument spans lines up to its trailing comma
            stop += 1
        edits.append((arg, stop + 1, COLLECTOR_ARG))
    else:
        raise SystemExit(f"unknown style {style!r}: use loop or collector")
    for a, b, new in sorted(edits, reverse=True):
        lines[a:b] = [new]
    return "".join(lines)


def main(argv: list[str]) -> int:
    path, style = Path(argv[0]), argv[1]
    pristine = path.read_text()
    patched = render(pristine, style)
    compile(patched, str(path), "exec")
    diff = difflib.unified_diff(
        pristine.splitlines(keepends=True),
        patched.splitlines(keepends=True),
        "a/sglang/srt/models/deepseek_v2.py",
        "b/sglang/srt/models/deepseek_v2.py",
        n=3,
    )
    sys.stdout.write("".join(diff))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
