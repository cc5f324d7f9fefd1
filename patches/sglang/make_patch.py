"""Maintainer tool: support SGLang releases, generated from their own wheels.

    python patches/sglang/make_patch.py add 0.5.24 [0.5.25 ...]   # one command per new release
    python patches/sglang/make_patch.py regen                      # every release in releases.json

For each release it downloads the wheel (`tests/sglang_wheels.py`, cached in
.cache/sglang-wheels), reads `deepseek_v2.py`, `kimi_k25.py`, `llama.py`, `kimi_k25_eagle3.py` and the
server options, renders the hidden-state dump patch, checks it, and writes
`v<version>/hs-dump.patch`, the release's row of `releases.json` and the matrix in
this folder's README. The engine reads only those files.

A release is refused here, not at the first forward, when the patch would not be
right: an anchor is missing or ambiguous, the patched file does not compile, a
name the inserted calls use is not bound in `DeepseekV2Model.forward` before the
call (the loop style on a release whose loop no longer holds `residual`), or the
diff does not apply and revert byte for byte.

Two patch styles, matching how SGLang captures aux states (DESIGN §3):
- loop (<= 0.5.13): the layer loop holds `hidden_states` and `residual`; the hook is
  called at the top of each iteration with both and sums them itself;
- collector (>= 0.5.14): the sum exists only inside the decoder layer, which hands it to
  a `captured_last_layer_outputs` collector; the patch passes the hook's collector
  there, teeing into SGLang's own one when EAGLE-3 also captures that layer.
Both end with `capture_final(hidden_states, forward_batch)` after the final norm.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagle3_dagster.sglang.patch import apply_unified_diff  # noqa: E402  (the checkout is put on sys.path above)
from eagle3_dagster.sglang_releases import ALWAYS_PLUS_ONE, EAGLE31_OPTIONS, PLUS_ONE_IF_FIRST_IS_ONE, TABLE  # noqa: E402  (the checkout is put on sys.path above)
from tests.sglang_wheels import read_file, run_set_eagle3_layers_to_capture  # noqa: E402  (the checkout is put on sys.path above)

HERE = Path(__file__).resolve().parent
MODEL_FILE = "sglang/srt/models/deepseek_v2.py"
# The MLA drafter Kimi's served drafts use (drafter.attention: mla)
MLA_DRAFTER_FILE = "sglang/srt/models/kimi_k25_eagle3.py"
MLA_DRAFTER_CLASS = "Eagle3DeepseekV2ForCausalLM"
HOOK = "_eagle3_hs_dump"

GUARD = f'''# eagle3-dagster: hidden-state dump for EAGLE-3 training (see eagle3_dagster/sglang/dump_hook.py).
# Inert unless SGLANG_HS_DUMP_DIR is set when this module is imported.
if __import__("os").environ.get("SGLANG_HS_DUMP_DIR"):
    from eagle3_dagster.sglang import dump_hook as {HOOK}
else:
    {HOOK} = None


'''
LOOP_CALL = (
    "{ind}if " + HOOK + " is not None:\n"
    "{ind}    " + HOOK + ".capture_layer_input(i, hidden_states, residual, forward_batch)\n"
)
FINAL_CALL = (
    "        if " + HOOK + " is not None:\n"
    "            " + HOOK + ".capture_final(hidden_states, forward_batch)\n"
)
COLLECTOR_ARG = (
    "{ind}captured_last_layer_outputs=" + HOOK + ".layer_collector(\n"
    "{ind}    i,\n"
    "{ind}    forward_batch,\n"
    "{ind}    aux_hidden_states if i in self.layers_to_capture else None,\n"
    "{ind})\n"
    "{ind}if " + HOOK + " is not None\n"
    "{ind}else (aux_hidden_states if i in self.layers_to_capture else None),\n"
)
# Options an extraction server needs, where the release has them (see dump_hook's refusals).
EXTRACTION_OPTIONS = [
    "--disable-radix-cache",  # every token computed: a cached prefix has no states
    "--chunked-prefill-size", "-1",  # whole prompts per forward
    "--disable-cuda-graph",  # the hook must run on every forward (decode graphs; <= 0.5.19 also ...)
    "--disable-piecewise-cuda-graph",  # ... the piecewise prefill graphs, on by default for DeepSeek-V3
    "--disable-prefill-cuda-graph",
    "--enforce-disable-flashinfer-allreduce-fusion",  # auto-on on Hopper/Blackwell for DeepSeek-V3 and K2.5, TP>1
    "--skip-server-warmup",
]

# Options a serving launch (the served benchmark) needs, where the release has them.
SERVING_OPTIONS = [
    # 0.5.10-0.5.23 turn FlashInfer all-reduce fusion on by themselves for DeepSeek-V3 and Kimi-K2.5 on Hopper and
    # Blackwell with TP > 1 (server_args.py, "Auto-enabling FlashInfer AllReduce Fusion"); SGLang's own EAGLE-3 aux
    # capture then sees per-rank partial sums, not the all-reduced states the drafter was trained on
    "--enforce-disable-flashinfer-allreduce-fusion",
]


class Refused(SystemExit):
    pass


def _find_one(lines: list[str], start: int, stop: int, predicate, what: str) -> int:
    hits = [k for k in range(start, stop) if predicate(lines[k])]
    if len(hits) != 1:
        raise Refused(f"anchor {what!r}: expected exactly 1 match in lines {start + 1}-{stop}, found {len(hits)}")
    return hits[0]


def detect_style(text: str) -> str:
    forward = _model_forward_source(text)
    if "captured_last_layer_outputs=" in forward:
        return "collector"
    if "aux_hidden_states.append(hidden_states + residual)" in forward:
        return "loop"
    raise Refused("DeepseekV2Model.forward captures aux states in neither known way; read it and extend make_patch")


def _model_forward(tree: ast.Module) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "DeepseekV2Model":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    return item
    raise Refused("no DeepseekV2Model.forward")


def _model_forward_source(text: str) -> str:
    return ast.get_source_segment(text, _model_forward(ast.parse(text))) or ""


def render(text: str, style: str) -> str:
    lines = text.splitlines(keepends=True)
    fn = _model_forward(ast.parse(text))
    start, end = fn.lineno - 1, fn.end_lineno
    cls = _find_one(lines, 0, len(lines), lambda s: s.startswith("class DeepseekV2Model("), "class DeepseekV2Model")
    loop = _find_one(lines, start, end, lambda s: s.strip() == "for i in range(normal_start_layer, normal_end_layer):",
                     "layer loop")
    final = _find_one(lines, start, end, lambda s: s == "        if len(aux_hidden_states) == 0:\n", "return")
    edits: list[tuple[int, int, str]] = [(cls, cls, GUARD), (final, final, FINAL_CALL)]
    if style == "loop":
        call = _find_one(lines, loop, end, lambda s: s.strip() == "layer = self.layers[i]", "layer = self.layers[i]")
        ind = " " * (len(lines[call]) - len(lines[call].lstrip()))
        edits.append((call, call, LOOP_CALL.format(ind=ind)))
    elif style == "collector":
        arg = _find_one(lines, loop, end, lambda s: s.strip().startswith("captured_last_layer_outputs="),
                        "captured_last_layer_outputs=")
        stop = arg
        while not lines[stop].rstrip().endswith(","):  # the argument spans lines up to its trailing comma
            stop += 1
        ind = " " * (len(lines[arg]) - len(lines[arg].lstrip()))
        edits.append((arg, stop + 1, COLLECTOR_ARG.format(ind=ind)))
    else:
        raise Refused(f"unknown style {style!r}")
    for a, b, new in sorted(edits, reverse=True):
        lines[a:b] = [new]
    patched = "".join(lines)
    compile(patched, MODEL_FILE, "exec")
    check_hook_names_bound(patched)
    return patched


def check_hook_names_bound(patched: str) -> None:
    """Every name an inserted hook call reads must be bound in DeepseekV2Model.forward before it."""
    fn = _model_forward(ast.parse(patched))
    bound: dict[str, int] = {a.arg: fn.lineno for a in (*fn.args.args, *fn.args.kwonlyargs)}
    for node in ast.walk(fn):
        targets = []
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            targets = [node.id]
        for name in targets:
            bound[name] = min(bound.get(name, node.lineno), node.lineno)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == HOOK]
    if len(calls) < 2:
        raise Refused(f"expected the hook calls in DeepseekV2Model.forward, found {len(calls)}")
    for call in calls:
        for n in ast.walk(call):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in (HOOK, "self"):
                if n.id in vars(builtins):
                    continue
                if n.id not in bound or bound[n.id] > call.lineno:
                    raise Refused(f"{HOOK}.{call.func.attr}(...) at line {call.lineno} reads {n.id!r}, which "
                                  "DeepseekV2Model.forward does not bind before it; this release needs another style")


def unified_diff(pristine: str, patched: str) -> str:
    return "".join(difflib.unified_diff(
        pristine.splitlines(keepends=True), patched.splitlines(keepends=True),
        f"a/{MODEL_FILE}", f"b/{MODEL_FILE}", n=3,
    ))


def _aux_rule(source: str | None, class_name: str) -> str | None:
    if source is None:
        return None
    probe = {tuple(run_set_eagle3_layers_to_capture(source, class_name, ids)) for ids in ([1, 29, 57], [2, 29, 57])}
    if probe == {(2, 30, 58), (3, 30, 58)}:
        return ALWAYS_PLUS_ONE
    if probe == {(2, 30, 58), (2, 29, 57)}:
        return PLUS_ONE_IF_FIRST_IS_ONE
    raise Refused(f"{class_name}.set_eagle3_layers_to_capture behaves in an unknown way: {sorted(probe)}")


def _server_sources(version: str) -> str:
    import zipfile

    from tests.sglang_wheels import wheel_path

    with zipfile.ZipFile(wheel_path(version)) as z:
        names = [n for n in z.namelist() if n == "sglang/srt/server_args.py"
                 or re.match(r"sglang/srt/arg_groups/.*\.py$", n)]
        return "\n".join(z.read(n).decode() for n in names)


def _has_option(sources: str, flag: str) -> bool:
    """Declared as a literal argparse flag, or as a server-args field exposed on the command line."""
    if f'"{flag}"' in sources:
        return True
    field = flag.lstrip("-").replace("-", "_")
    decls = re.findall(rf"^\s+{field}: .*?\] = ", sources, flags=re.M | re.S)  # the whole A[...] annotation
    return bool(decls) and not any("no_cli=True" in d for d in decls)


def eagle31_options(source: str | None) -> list[str]:
    """The EAGLE 3.1 config.json options a release's `llama_eagle3.py` reads (`getattr(config, "fc_norm", ...)`)."""
    if source is None:
        return []
    read = {node.args[1].value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)}
    return [o for o in EAGLE31_OPTIONS if o in read]


def analyze(version: str) -> tuple[dict, str]:
    """(releases.json row, patch text) for one release, or Refused naming why."""
    pristine = read_file(version, MODEL_FILE)
    if pristine is None:
        raise Refused(f"sglang {version}: no {MODEL_FILE}")
    kimi = read_file(version, "sglang/srt/models/kimi_k25.py")
    serves_k25 = kimi is not None and "def set_eagle3_layers_to_capture" in kimi
    style = detect_style(pristine)
    patched = render(pristine, style)
    diff = unified_diff(pristine, patched)
    if apply_unified_diff(pristine, diff) != patched or apply_unified_diff(patched, diff, reverse=True) != pristine:
        raise Refused(f"sglang {version}: the rendered diff does not apply and revert byte for byte")
    sources = _server_sources(version)
    args: list[str] = []
    for k, opt in enumerate(EXTRACTION_OPTIONS):
        if opt.startswith("--") and _has_option(sources, opt):
            args.append(opt)
            if k + 1 < len(EXTRACTION_OPTIONS) and not EXTRACTION_OPTIONS[k + 1].startswith("--"):
                args.append(EXTRACTION_OPTIONS[k + 1])
    for required in ("--disable-radix-cache", "--chunked-prefill-size", "--disable-cuda-graph"):
        if required not in args:
            raise Refused(f"sglang {version}: server option {required} not found; extraction cannot be made exact")
    row = {
        "version": version,
        "pristine_sha256": hashlib.sha256(pristine.encode()).hexdigest(),
        "patched_sha256": hashlib.sha256(patched.encode()).hexdigest(),
        "style": style,
        "serves_kimi_k25_eagle3": serves_k25,
        "aux_id_rules": {
            "deepseek": _aux_rule(pristine, "DeepseekV2ForCausalLM"),
            "llama": _aux_rule(read_file(version, "sglang/srt/models/llama.py"), "LlamaForCausalLM"),
        },
        "extraction_args": args,
        "serving_args": [opt for opt in SERVING_OPTIONS if _has_option(sources, opt)],
        "capture_only_mode": _has_option(sources, "--enable-return-aux-hidden-states"),
        "eagle31_options": eagle31_options(read_file(version, "sglang/srt/models/llama_eagle3.py")),
        "mla_drafter": mla_drafter(read_file(version, MLA_DRAFTER_FILE)),
    }
    return row, diff


def refuse_unless_serves(row: dict) -> None:
    if not row["serves_kimi_k25_eagle3"]:
        raise Refused(f"sglang {row['version']}: KimiK25ForConditionalGeneration is missing or has no "
                      "set_eagle3_layers_to_capture, so it cannot serve Kimi-K2.5 with EAGLE-3")


def _version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.]|post", v) if x != "")


def write(rows: dict[str, dict], diffs: dict[str, str]) -> None:
    for version, diff in diffs.items():
        folder = HERE / f"v{version}"
        folder.mkdir(exist_ok=True)
        (folder / "hs-dump.patch").write_text(diff)
    ordered = [rows[v] for v in sorted(rows, key=_version_key)]
    TABLE.write_text(json.dumps({"generated_by": "patches/sglang/make_patch.py", "releases": ordered}, indent=1) + "\n")
    readme = HERE / "README.md"
    text = readme.read_text()
    begin, end = "<!-- matrix:begin -->", "<!-- matrix:end -->"
    table = matrix(ordered)
    text = text[: text.index(begin) + len(begin)] + "\n" + table + text[text.index(end):]
    readme.write_text(text)


def mla_drafter(source: str | None) -> list[str] | None:
    """None when a release cannot load an MLA drafter (no `Eagle3DeepseekV2ForCausalLM` in `kimi_k25_eagle3.py`),
    else the EAGLE 3.1 config.json options that file reads (0.5.12's reads none)."""
    if source is None or not any(isinstance(node, ast.ClassDef) and node.name == MLA_DRAFTER_CLASS
                                 for node in ast.walk(ast.parse(source))):
        return None
    return eagle31_options(source)


def matrix(rows: list[dict]) -> str:
    out = ["| release | serves Kimi-K2.5 with EAGLE-3 | extraction path | patch | aux ids (DeepSeek / Llama) "
           "| extraction options | serving options | MLA drafter |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        path = "patch (dump hook)" + (" — capture-only mode exists, not used" if r["capture_only_mode"] else "")
        rules = " / ".join(r["aux_id_rules"][k] or "–" for k in ("deepseek", "llama"))
        out.append(f"| {r['version']} | {'yes' if r['serves_kimi_k25_eagle3'] else 'no'} | {path} | "
                   f"{r['style']}, verified | {rules} | `{' '.join(r['extraction_args'])}` "
                   f"| `{' '.join(r['serving_args'])}` | {_mla_cell(r['mla_drafter'])} |")
    return "\n".join(out) + "\n"


def _mla_cell(options: list[str] | None) -> str:
    if options is None:
        return "no"
    return "yes" + (f" ({', '.join(options)})" if options else " (no EAGLE 3.1 options)")


def main(argv: list[str]) -> int:
    command, versions = argv[0], argv[1:]
    rows = {r["version"]: r for r in json.loads(TABLE.read_text())["releases"]} if TABLE.exists() else {}
    if command == "regen":
        versions = list(rows)
    elif command != "add":
        raise SystemExit("usage: make_patch.py add VERSION... | regen")
    diffs = {}
    for version in versions:
        row, diff = analyze(version)
        refuse_unless_serves(row)
        rows[version], diffs[version] = row, diff
        print(f"{version}: {row['style']}, patched sha256 {row['patched_sha256'][:12]}")
    write(rows, diffs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
