"""The Python a target folder carries, file by file with its sha256, and the check against what was reviewed.

Owns: `code_files` (every `*.py` of the folder at any depth, and every module an `auto_map` of its configs
names: what `--trust-remote-code` runs in transformers and in SGLang, e.g. Kimi-K2.5's
`kimi_k25_processor.py`, `tokenization_kimi.py`), and `check_reviewed` (the profile's `target.reviewed_code`,
file name → sha256: any code file it does not list, or lists with another hash, is refused, naming the file
and both hashes). `eagle3_dagster.target` puts the files into the target's identity; the callers that run
the code (the tokenizer loader, the SGLang launch) call the check first.

Standard library only: the GPU host's interpreter runs this file as a program (`gpu_host.program_argv`)
on the folder there, before SGLang is launched with `--trust-remote-code`:

    python target_code.py list DIR               # {"name": "sha256", ...}
    python target_code.py check DIR REVIEWED_JSON  # exit 3 and the refusal when the code is not the reviewed one
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

# The configs whose `auto_map` names code transformers imports (`module.Class` → module.py in the folder).
AUTO_MAP_CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
EXIT_UNREVIEWED = 3


class UnreviewedCodeError(ValueError):
    """Code the target would run is not the code `target.reviewed_code` lists."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def auto_map_modules(model_dir: Path) -> set[str]:
    """The files (`module.py`) the configs' `auto_map` entries name in the folder itself; a reference to another
    repository's code (`org/repo--module.Class`) is the tokenizer loader's to refuse."""
    found = set()
    for config in AUTO_MAP_CONFIGS:
        try:
            auto_map = json.loads((model_dir / config).read_text()).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for refs in auto_map.values() if isinstance(auto_map, dict) else ():
            for ref in refs if isinstance(refs, list) else [refs]:
                if isinstance(ref, str) and "--" not in ref and "." in ref:
                    name = ref.rsplit(".", 1)[0] + ".py"
                    if "/" not in name and "\0" not in name and name not in (".py", "..py"):
                        found.add(name)
    return found


def code_files(model_dir: str | Path) -> dict[str, str]:
    """name (relative to the folder, '/'-separated) → sha256 of each code file: every `*.py` at any depth (through
    symbolic links too, each real folder once: code a link points at runs all the same) and each file an
    `auto_map` names. A code file that is not a regular file (a FIFO, a device, a link to one) is refused: its
    bytes cannot be pinned."""
    model_dir = Path(model_dir)
    names = set(auto_map_modules(model_dir))
    seen = {os.path.realpath(model_dir)}
    for root, dirs, files in os.walk(model_dir, followlinks=True):
        kept = []
        for d in dirs:  # each real folder once: links may loop or meet
            if (real := os.path.realpath(os.path.join(root, d))) not in seen:
                seen.add(real)
                kept.append(d)
        dirs[:] = kept
        names.update((Path(root) / f).relative_to(model_dir).as_posix() for f in files if f.endswith(".py"))
    out = {}
    for name in sorted(names):
        path = model_dir / name
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            continue  # an auto_map naming a file the folder lacks: nothing runs from it
        if not stat.S_ISREG(mode):
            raise UnreviewedCodeError(f"{path}: a code file of the target that is not a regular file")
        out[name] = _sha256(path)
    return out


def unreviewed(files: Mapping[str, str], reviewed: Mapping[str, str]) -> list[str]:
    """What keeps `files` from being the reviewed code: each file not listed, or listed with another hash."""
    problems = []
    for name, digest in sorted(files.items()):
        want = reviewed.get(name)
        if want is None:
            problems.append(f"{name} (sha256 {digest}) is not in target.reviewed_code")
        elif str(want).lower() != digest:
            problems.append(f"{name} has sha256 {digest}, target.reviewed_code has {want}")
    return problems


def check_reviewed(model_dir: str | Path, reviewed: Mapping[str, str] | None) -> dict[str, str]:
    """The folder's code files, when `reviewed` is unset or lists each of them with its hash; else
    UnreviewedCodeError naming every file that differs and both hashes."""
    files = code_files(model_dir)
    if reviewed is not None and (problems := unreviewed(files, reviewed)):
        raise UnreviewedCodeError(
            f"{model_dir}: the target's code is not the reviewed code, and target.trust_remote_code would run it: "
            + "; ".join(problems)
            + ". Read the files, then list them with their sha256 in target.reviewed_code"
        )
    return files


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "list":
        print(json.dumps(code_files(argv[1]), sort_keys=True))
        return 0
    if len(argv) == 3 and argv[0] == "check":
        try:
            check_reviewed(argv[1], json.loads(argv[2]))
        except UnreviewedCodeError as e:
            print(e, file=sys.stderr)
            return EXIT_UNREVIEWED
        return 0
    print("usage: target_code.py list DIR | check DIR REVIEWED_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
