"""The README and docs/ run as written: every fenced Python block is executed
in a fresh interpreter (a block starting with ``>>>`` as a doctest), a
``print(...)  # -> text`` line's output is checked (``...`` matches
anything), every ``flashmetal`` command line of a shell block is run, and
shell lines work in zsh as in bash (no unquoted brackets). A block that
cannot run here carries ``<!-- readme-test: skip, <reason> -->`` on the line
before it; such marks are rare (at most one) and say why (a Mac)."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARK = re.compile(r"^<!-- readme-test: skip, (.+) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")
#: Packages a block may need beyond flashmetal's own dependencies: installed
#: into the Makefile's venv for the tests, so there every block runs.
OPTIONAL = ("torch", "transformers", "mlx", "mlx_lm")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason of a skip mark, or None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        mark = SKIP_MARK.match(lines[start - 1].strip()) if start else None
        out.append(Block(path, start + 1, m.group(1), "\n".join(body) + "\n", mark.group(1) if mark else None))
        i += 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]
PYTHON = [b for b in ALL if b.lang == "python"]
SHELL = [b for b in ALL if b.lang in ("sh", "bash", "shell", "zsh")]


def _imports(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _venv_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _doctest_runner(code: str) -> str:
    return ("import doctest, sys\n"
            f"test = doctest.DocTestParser().get_doctest({code!r}, {{}}, 'readme', None, 0)\n"
            "runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)\n"
            "runner.run(test)\n"
            "sys.exit(1 if runner.failures else 0)\n")


def _expected_prints(code: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*->\s*(.+)$", code, re.M)]


def _matches(pattern: str, line: str) -> bool:
    return re.fullmatch(".*".join(re.escape(p) for p in pattern.split("...")), line.strip()) is not None


def test_skip_marks_are_rare_and_justified():
    marked = [b for b in ALL if b.skip is not None]
    assert len(marked) <= 1, [b.where for b in marked]
    for b in marked:
        assert b.lang == "python" and "Mac" in b.skip, (b.where, b.skip)
        compile(b.code, b.where, "exec")  # still valid Python


def test_every_python_block_is_found():
    readme = [b for b in PYTHON if b.path.name == "README.md"]
    assert len(readme) >= 8, [b.where for b in readme]


def _param(block: Block, heavy: bool) -> object:
    """A block that imports a framework (seconds each) runs in `make test`, not `make quick`."""
    return pytest.param(block, marks=pytest.mark.slow, id=block.where) if heavy else \
        pytest.param(block, id=block.where)


@pytest.mark.parametrize("block", [_param(b, bool(_imports(b.code) & set(OPTIONAL)))
                                   for b in PYTHON if b.skip is None])
def test_python_block_runs(block):
    for name in sorted(_imports(block.code) & set(OPTIONAL)):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{block.where} needs {name}, not installed here (the Makefile's venv has it)")
    repl = block.code.lstrip().startswith(">>>")
    source = _doctest_runner(block.code) if repl else block.code
    r = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=_venv_env())
    assert r.returncode == 0, f"{block.where} failed:\n{r.stdout}\n{r.stderr}"
    out = r.stdout.splitlines()
    for want in _expected_prints(block.code):
        hit = next((i for i, line in enumerate(out) if _matches(want, line)), None)
        assert hit is not None, f"{block.where}: no output line matches {want!r} in\n{r.stdout}"
        out = out[hit + 1:]


def _shell_lines(block: Block) -> list[str]:
    return [line for line in block.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_shell_lines_work_in_zsh_and_bash(block):
    """zsh (macOS's shell) globs an unquoted ``[...]`` and fails when nothing
    matches (``pip install ./python[hf]``); every line also parses in bash."""
    for line in _shell_lines(block):
        words = shlex.split(line, comments=True)
        lexer = shlex.shlex(line, posix=False)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        for word in lexer:
            if "[" in word and not (word[0] in "'\"" and word[-1] == word[0]):
                pytest.fail(f"{block.where}: unquoted bracket in {word!r} ({line!r}): zsh globs it")
        assert words, line
        r = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True)
        assert r.returncode == 0, (block.where, line, r.stderr)


CLI = [(b, line) for b in SHELL for line in _shell_lines(b) if line.split()[0] == "flashmetal"]


def test_the_command_line_section_is_found():
    assert len(CLI) >= 3, CLI


@pytest.mark.parametrize("block,line", [pytest.param(b, line, id=f"{b.where}:{line.split()[1]}",
                                                    marks=[pytest.mark.slow] if line.split()[1] == "bench" else [])
                                       for b, line in CLI])
def test_command_line_runs(block, line):
    r = subprocess.run(shlex.split(line, comments=True), capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=_venv_env())
    assert r.returncode == 0, f"{block.where}: {line}\n{r.stdout}\n{r.stderr}"


def test_relative_links_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"


def test_the_checks_catch_what_they_look_for():
    """A REPL block whose output differs, and a print whose expectation is
    not met, fail; matching ones pass."""
    def run(code):
        return subprocess.run([sys.executable, "-c", _doctest_runner(code)], capture_output=True, text=True,
                              timeout=120).returncode
    assert run(">>> import flashmetal as fm\n>>> fm.abi_version() == fm.info()['abi_version']\nTrue\n") == 0
    assert run(">>> 1 + 1\n3\n") == 1
    assert _expected_prints("x = 1\nprint(x)  # -> 1\nprint(2)  # two\n") == ["1"]
    assert _matches("... looks transposed: ...", "op: a. The layout looks transposed: swap")
    assert not _matches("... looks transposed", "op: shapes differ")


def _make_targets() -> set[str]:
    text = "\n".join(p.read_text() for p in [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))])
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M)}


def test_make_lines_name_real_targets():
    """`make demo`, `make test`, `make wheel` ... exist, and the wheel lands
    where the install section says."""
    targets = _make_targets()
    for b in SHELL:
        for line in _shell_lines(b):
            words = shlex.split(line, comments=True)
            if words[0] == "make":
                for target in words[1:] or ["all"]:
                    assert target in targets, f"{b.where}: make {target} is no target"
    readme = (ROOT / "README.md").read_text()
    wheel_dir = re.search(r"^WHEEL_DIR\s*[:?]?=\s*(\S+)", (ROOT / "mk" / "wheel.mk").read_text(), re.M)
    assert wheel_dir and f"pip install {wheel_dir.group(1)}/flashmetal-*.whl" in readme


def test_readme_stays_a_newcomers_page():
    """What it is, install, the two commands, a tour and links: reference
    material belongs in docs/API.md and the other docs/ pages."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; move reference material to docs/"
