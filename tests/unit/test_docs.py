"""The docs check: README.md and docs/*.md name only what the tree has.

- Every relative link resolves, `#anchors` included (GitHub's heading slugs), within a page and across pages.
- Every project command a page shows, in a shell code block or an inline code span, parses: scripts/*.py,
  benchmarks/*.py and the eagle3 command run with `--help` appended and must exit 0 with a usage text.
  A bash script (scripts/*.sh) must exist, be executable and pass `bash -n`; when it hands its arguments
  to a Python script (`exec ... scripts/x.py "$@"`) or to pytest, those arguments are checked there.
- Every profile a page names (`configs/X.yaml`, `--profile X`, `EAGLE3_PROFILE=X`) loads.
- Every profile fragment a page shows (a yaml code block whose keys are profile sections) loads, merged
  into the production profile.
- Every repository path a page shows in an inline code span exists.

`--help` runs are batched: one interpreter per script (or module) runs each distinct argument list the pages
show for it, in-process through runpy, so a script's imports are paid once (scripts/production_plan.py and
scripts/run_pipeline.py import torch and Dagster: several seconds each on a slow machine).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
YAML_LANGS = {"yaml", "yml"}
# Top-level folders whose paths an inline code span may name; each must exist.
TREE_DIRS = (
    "assets",
    "benchmarks",
    "configs",
    "deploy",
    "docs",
    "eagle3_dagster",
    "patches",
    "resources",
    "scripts",
    "tests",
    "dagster_home",
    ".ci",
)
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", ";;", "|&"}
# A bash script that hands its arguments on: `exec <interpreter> scripts/x.py "$@"` or `exec ... -m pytest ... "$@"`.
FORWARD = re.compile(r'^\s*exec\s+\S+\s+(?:-m\s+(?P<module>[\w.]+)|(?P<script>scripts/[\w.-]+\.py))[^\n]*"\$@"', re.M)
PYTEST_VALUE_OPTIONS = {"-m", "-k", "-p", "-o", "-c", "--rootdir", "--durations", "--timeout"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


# --------------------------------------------------------------------------------------------- reading pages


@dataclass
class Page:
    path: Path
    slugs: set[str] = field(default_factory=set)
    links: list[tuple[int, str]] = field(default_factory=list)  # (line, target)
    code: list[tuple[int, str]] = field(default_factory=list)  # (first line, text) of each shell code block
    yaml: list[tuple[int, str]] = field(default_factory=list)  # (first line, text) of each yaml code block
    spans: list[tuple[int, str]] = field(default_factory=list)  # (line, text) of each inline code span


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links and code marks dropped) lower-cased, punctuation other
    than `-` and `_` removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def read_page(path: Path) -> Page:
    page = Page(path)
    prose: list[str] = []  # the page with code blocks blanked, so offsets map to line numbers
    fence: str | None = None
    counts: dict[str, int] = {}
    block: list[str] = []
    block_start, block_lang = 0, ""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        opener = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and opener:
            fence, block, block_start, block_lang = opener.group(1), [], number + 1, opener.group(2).lower()
            prose.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                if block_lang in SHELL_LANGS:
                    page.code.append((block_start, "\n".join(block)))
                elif block_lang in YAML_LANGS:
                    page.yaml.append((block_start, "\n".join(block)))
                fence = None
            else:
                block.append(line)
            prose.append("")
            continue
        prose.append(line)
        heading = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            page.slugs.add(base if n == 0 else f"{base}-{n}")
    text = "\n".join(prose)

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    for span in re.finditer(r"`([^`]+)`", text):
        page.spans.append((line_of(span.start()), " ".join(span.group(1).split())))
    unspanned = re.sub(r"`[^`]+`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for link in re.finditer(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", unspanned):
        page.links.append((line_of(link.start()), link.group(1)))
    for ref in re.finditer(r"^\s*\[[^\]]+\]:\s*(\S+)", unspanned, re.M):
        page.links.append((line_of(ref.start()), ref.group(1)))
    return page


# ------------------------------------------------------------------------------------------------ links


def broken_links(page: Page, pages: dict[Path, Page], root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in page.links:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        where = f"{rel(page.path)}:{number}: ({target})"
        path_part, _, anchor = target.partition("#")
        dest = (page.path.parent / path_part).resolve() if path_part else page.path.resolve()
        if not dest.is_relative_to(root):
            problems.append(f"{where} points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where} names no file")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(f"{where} has an anchor into a file that is not markdown")
                continue
            linked = pages.get(dest) or read_page(dest)
            if anchor not in linked.slugs:
                problems.append(
                    f"{where}: no heading of {rel(dest)} has the slug #{anchor} (it has {sorted(linked.slugs)})"
                )
    return problems


# --------------------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    kind: str  # "bash" (a scripts/*.sh), "help" (a Python script or module run with --help), "pytest", "file"
    target: str  # the script's repository path, or the module's name
    args: tuple[str, ...]

    def __str__(self) -> str:
        shown = {"eagle3_dagster.cli": "eagle3", "pytest": "pytest"}.get(self.target, self.target)
        return " ".join([shown, *self.args])


class Unparsable(ValueError):
    pass


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line: words between operators, redirections cut off."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as e:  # an unclosed quote
        raise Unparsable(f"{line!r}: {e}") from None
    commands, current = [], []
    for token in tokens + [";"]:
        if token in OPERATORS:
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    out = []
    for words in commands:
        for i, word in enumerate(words):  # `cmd ... > file`, `cmd 2>&1`: the arguments end at a redirection
            if word[:1] in ("<", ">") or word in {"&>", ">&"}:
                words = words[: i - 1] if i and words[i - 1].isdigit() else words[:i]
                break
        while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] in {"exec", "time", "do", "then", "else"}):
            words = words[1:]
        if words:
            out.append(words)
    return out


def classify(words: list[str]) -> Command | None:
    """The project command these words run, or None for anyone else's (dagster, pip, cat, torchrun...)."""
    program, args = words[0].removeprefix("./"), words[1:]
    if re.fullmatch(r"scripts/[\w.-]+\.sh", program):
        return Command("bash", program, tuple(args))
    if re.fullmatch(r"scripts/[\w.-]+\.py", program):
        return Command("help", program, tuple(args))
    if program in {"eagle3", ".venv/bin/eagle3"}:
        return Command("help", "eagle3_dagster.cli", tuple(args))
    if program in {"pytest", ".venv/bin/pytest"}:
        return Command("pytest", "pytest", tuple(args))
    if PYTHON.search(program) and args:
        if args[0] == "-m" and len(args) > 1:
            if args[1] == "eagle3_dagster.cli":
                return Command("help", args[1], tuple(args[2:]))
            if args[1] == "pytest":
                return Command("pytest", "pytest", tuple(args[2:]))
            return None
        script = args[0].removeprefix("./")
        if re.fullmatch(r"(scripts|benchmarks)/[\w.-]+\.py", script):
            return Command("help", script, tuple(args[1:]))
        if script.endswith(".py"):
            return Command("file", script, ())
    return None


def commands_shown(page: Page) -> list[tuple[str, Command | str]]:
    """(where, command) for each project command the page shows; a str instead of a command is a line the
    shell could not parse."""
    found = []
    for start, block in page.code:
        joined = re.sub(r"\\\n", " ", block)  # continuation lines
        for offset, line in enumerate(joined.splitlines()):
            line = line.strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            found += _commands_of(f"{rel(page.path)}:{start + offset}", line)
    for number, span in page.spans:
        found += _commands_of(f"{rel(page.path)}:{number}", span, quiet=True)
    return found


def _commands_of(where: str, line: str, quiet: bool = False) -> list[tuple[str, Command | str]]:
    try:
        words = simple_commands(line)
    except Unparsable as e:
        # An inline span is often not a command at all (`Kimi's`); a code block's line must parse when it is one.
        first = line.split()[0] if line.split() else ""
        return [] if quiet and classify([first]) is None else [(where, str(e))]
    return [(where, c) for c in map(classify, words) if c is not None]


def _bash_forward(script: Path) -> tuple[str, str] | None:
    """("script", path) or ("module", name) when the bash script hands "$@" to Python."""
    m = FORWARD.search(script.read_text())
    if m is None:
        return None
    return ("module", m.group("module")) if m.group("module") else ("script", m.group("script"))


class HelpRuns:
    """`--help` of Python scripts and modules: at the first call, every one the pages show, in one interpreter
    (torch, transformers and Dagster are imported once, not once per script)."""

    DRIVER = r"""
import contextlib, io, json, runpy, sys
out_path, runs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, ".")
results = []
for target, args in runs:
    buf, saved = io.StringIO(), list(sys.argv)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            sys.argv = [target, *args, "--help"]
            try:
                if target.endswith(".py"):
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                code = "ran to its end without honouring --help"
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code)
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException as e:
                code = f"raised {type(e).__name__}: {e}"
    finally:
        sys.argv = saved
    out = buf.getvalue()  # argparse's "usage:" line opens it, an error closes it: keep both ends of a long help
    results.append({"target": target, "args": args, "code": code,
                    "output": out if len(out) <= 3000 else out[:1000] + "\n[...]\n" + out[-2000:]})
with open(out_path, "w") as f:
    json.dump(results, f)
"""

    def __init__(self, wanted: dict[str, set[tuple[str, ...]]]) -> None:
        self.wanted = wanted
        self.results: dict[tuple[str, tuple[str, ...]], dict] = {}

    def __call__(self, target: str, args: tuple[str, ...], tmp_dir: Path) -> dict:
        if (target, args) not in self.results:
            runs = {(target, args)} | {(t, a) for t, argses in self.wanted.items() for a in argses}
            self.wanted = {}
            out = tmp_dir / f"help-{len(self.results)}.json"
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
            proc = subprocess.run(
                [sys.executable, "-c", self.DRIVER, str(out), json.dumps(sorted(runs))],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert proc.returncode == 0 and out.exists(), (
                f"the --help driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
            for r in json.loads(out.read_text()):
                self.results[(r["target"], tuple(r["args"]))] = r
        return self.results[(target, args)]


def command_problems(command: Command, help_runs: HelpRuns, tmp_dir: Path) -> list[str]:
    if command.kind == "file":
        return [] if (ROOT / command.target).is_file() else [f"{command.target} does not exist"]
    if command.kind == "pytest":
        return pytest_arg_problems(command.args)
    if command.kind == "help":
        if command.target.endswith(".py") and not (ROOT / command.target).is_file():
            return [f"{command.target} does not exist"]
        r = help_runs(command.target, command.args, tmp_dir)
        if r["code"] != 0 or "usage:" not in r["output"]:
            return [f"`{command} --help` exited {r['code']}:\n{r['output']}"]
        return []
    script = ROOT / command.target  # bash
    if not script.is_file():
        return [f"{command.target} does not exist"]
    problems = []
    if not os.access(script, os.X_OK):
        problems.append(f"{command.target} is not executable")
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    if syntax.returncode != 0:
        problems.append(f"bash -n {command.target}: {syntax.stderr}")
    forward = _bash_forward(script)
    if forward is None:
        if command.args and not re.search(r"\$\{?[1-9@*]", script.read_text()):
            problems.append(f"{command.target} takes no arguments, but is shown with {' '.join(command.args)}")
    elif forward == ("module", "pytest"):
        problems += pytest_arg_problems(command.args)
    elif forward[0] == "script":
        problems += command_problems(Command("help", forward[1], command.args), help_runs, tmp_dir)
    return problems


def pytest_arg_problems(args: tuple[str, ...]) -> list[str]:
    problems, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in PYTEST_VALUE_OPTIONS:
            skip = True
        elif not arg.startswith("-") and ("/" in arg or arg.endswith(".py")):
            path = arg.split("::")[0]
            if not (ROOT / path).exists():
                problems.append(f"pytest is given {arg}, and {path} does not exist")
    return problems


# --------------------------------------------------------------------------------------------- profiles

PROFILE_NAMES = [
    re.compile(r"(?<![\w./-])configs/([\w-]+)\.ya?ml\b"),
    re.compile(r"--profile[= ]+([\w./-]*\w)"),
    re.compile(r"\bEAGLE3_PROFILE=([\w./-]*\w)"),
]


def profiles_named(page: Page) -> list[tuple[str, str]]:
    found = []
    for number, line in enumerate(page.path.read_text().splitlines(), start=1):
        for pattern in PROFILE_NAMES:
            for m in pattern.finditer(line):
                found.append((f"{rel(page.path)}:{number}", m.group(1)))
    return found


# ------------------------------------------------------------------------------------- what the pages show

READ = {p.resolve(): read_page(p) for p in PAGES}
SHOWN: dict[Command | str, list[str]] = {}
for _page in READ.values():
    for _where, _command in commands_shown(_page):
        SHOWN.setdefault(_command, []).append(_where)
PROFILES: dict[str, list[str]] = {}
for _page in READ.values():
    for _where, _name in profiles_named(_page):
        PROFILES.setdefault(_name, []).append(_where)


def _help_targets() -> dict[str, set[tuple[str, ...]]]:
    wanted: dict[str, set[tuple[str, ...]]] = {}
    for c in SHOWN:
        if isinstance(c, str):
            continue
        if c.kind == "bash" and (ROOT / c.target).is_file():
            forward = _bash_forward(ROOT / c.target)
            if forward and forward[0] == "script":
                c = Command("help", forward[1], c.args)
        if c.kind == "help":
            wanted.setdefault(c.target, set()).add(c.args)
    return wanted


HELP = HelpRuns(_help_targets())


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(READ[page.resolve()], READ) == []


@pytest.mark.parametrize("command", list(SHOWN), ids=str)
def test_every_command_a_page_shows_parses(command, tmp_path_factory) -> None:
    where = ", ".join(SHOWN[command])
    assert not isinstance(command, str), f"{where}: the shell cannot parse {command}"
    problems = command_problems(command, HELP, tmp_path_factory.mktemp("help"))
    assert problems == [], f"{where}: " + "\n".join(problems)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_a_page_names_loads(name: str) -> None:
    from eagle3_dagster.config import load_profile

    value = str(ROOT / name) if name.endswith((".yaml", ".yml")) and not os.path.isabs(name) else name
    try:
        load_profile(value)
    except Exception as e:  # the message names the page that shows it
        pytest.fail(f"{', '.join(PROFILES[name])}: profile {name!r} does not load: {e}")


def fragment_problems(page: Page) -> list[str]:
    """A yaml block whose top-level keys are all profile sections, merged into the production profile, must load;
    other yaml (Dagster run config, instance files) is not a profile's."""
    import yaml

    from eagle3_dagster.config import Profile, ProfileError, load_profile

    problems = []
    for number, text in page.yaml:
        block = yaml.safe_load(text)
        if not isinstance(block, dict) or not set(block) <= set(Profile.model_fields):
            continue
        try:
            load_profile("production", overrides=block)
        except ProfileError as e:
            problems.append(f"{rel(page.path)}:{number}: {e}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_profile_fragment_a_page_shows_loads(page: Path) -> None:
    assert fragment_problems(READ[page.resolve()]) == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_repository_path_a_page_shows_exists(page: Path) -> None:
    doc = READ[page.resolve()]
    missing = []
    for number, span in doc.spans:
        first = span.split(" ")[0].removeprefix("./").split("::")[0]
        if re.fullmatch(rf"(?:{'|'.join(map(re.escape, TREE_DIRS))})/[\w./-]*", first) and not (ROOT / first).exists():
            missing.append(f"{rel(page)}:{number}: {first}")
    assert missing == []


# --------------------------------------------------------------------------------- the check checks itself


def test_the_pages_show_what_the_check_looks_for() -> None:
    """A parser that found nothing would pass every page: the README's own commands must be seen."""
    shown = {str(c) for c in SHOWN}
    assert {"scripts/demo.sh", "scripts/test.sh", "scripts/ui.sh", "eagle3 plan"} <= shown
    assert {"demo", "micro", "production"} <= set(PROFILES)
    assert "drafter-quality-by-training-recipe" in READ[(ROOT / "docs" / "benchmarks.md").resolve()].slugs
    assert sum(text.startswith("gpu_host:") for _, text in READ[(ROOT / "docs" / "gpu-hosts.md").resolve()].yaml) == 2


def test_slugs_are_githubs() -> None:
    assert slug("The `eagle3` command") == "the-eagle3-command"
    assert slug("Device check (one CUDA GPU)") == "device-check-one-cuda-gpu"
    assert slug("run_root is local") == "run_root-is-local"
    assert (
        slug("Production instance: PostgreSQL, separate processes")
        == "production-instance-postgresql-separate-processes"
    )
    assert slug("[storage](docs/storage.md) on S3") == "storage-on-s3"


def test_a_broken_link_anchor_command_or_profile_is_reported(tmp_path) -> None:
    page_path = tmp_path / "page.md"
    page_path.write_text(
        "# Title\n\n[ok](#title) [gone](#nowhere) [lost](no_such_file.md)\n\n"
        "```bash\neagle3 export-shards --format nope --out DIR\nscripts/no_such.sh\n```\n"
    )
    page = read_page(page_path)
    problems = broken_links(page, {page_path.resolve(): page}, root=tmp_path)
    assert [p.split(": (")[1].split(")")[0] for p in problems] == ["#nowhere", "no_such_file.md"]
    commands = [c for _, c in commands_shown(page)]
    assert commands == [
        Command("help", "eagle3_dagster.cli", ("export-shards", "--format", "nope", "--out", "DIR")),
        Command("bash", "scripts/no_such.sh", ()),
    ]
    bad_choice = command_problems(commands[0], HelpRuns({}), tmp_path)
    assert len(bad_choice) == 1 and "invalid choice: 'nope'" in bad_choice[0]
    assert command_problems(commands[1], HelpRuns({}), tmp_path) == ["scripts/no_such.sh does not exist"]
    from eagle3_dagster.config import ProfileError, load_profile

    with pytest.raises(ProfileError):
        load_profile("no_such_profile")
    fragment = tmp_path / "fragment.md"
    fragment.write_text("```yaml\ngpu_host:\n  transport: ssh\n```\n\n```yaml\nops: {x: 1}\n```\n")
    (flat,) = fragment_problems(read_page(fragment))
    assert flat.startswith("fragment.md:2: ") and "gpu_host.transport: a host's fields go in the list" in flat
