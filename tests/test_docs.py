"""The guides' Python runs as written: every ```python block of docs/cache.md and
docs/storage.md, in order, in one namespace per page (as a reader would paste them),
in a scratch directory. A ``print`` line carries ``# -> TEXT``: what it prints
(``...`` stands for anything; two spaces and a parenthesis start a remark)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
SAYS = re.compile(r"#\s*->\s*(.*)$")


def expected_lines(code: str) -> list[re.Pattern[str]]:
    wanted = []
    for line in code.splitlines():
        if not line.lstrip().startswith("print("):
            continue
        said = SAYS.search(line)
        assert said, f"a print in the docs says what it prints (# -> TEXT): {line.strip()}"
        text = said.group(1).split("  (")[0].strip()
        wanted.append(re.compile(".*".join(re.escape(part) for part in text.split("..."))))
    return wanted


@pytest.mark.parametrize("page", ["cache.md", "storage.md"])
def test_every_python_block_of_the_page_runs_and_prints_what_it_says(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = BLOCK.findall((DOCS / page).read_text())
    assert blocks, f"{page} has no python blocks"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    printed = io.StringIO()
    wanted: list[re.Pattern[str]] = []
    for code in blocks:
        wanted += expected_lines(code)
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{page}", "exec"), namespace)  # the page's own examples
    lines = printed.getvalue().splitlines()
    assert len(lines) == len(wanted), lines
    for line, pattern in zip(lines, wanted, strict=True):
        assert pattern.fullmatch(line), f"{page} says {pattern.pattern!r}, printed {line!r}"


# ---------------------------------------------------------------- commands the docs name
#
# Every ``prefixcache SUBCOMMAND --flag`` written in README.md or docs/*.md (code blocks
# and inline code) must be one the real parser accepts; every ``make TARGET`` of the
# README a Makefile target; every benchmarks/, tests/ or docs/ path a file. A reader who
# pastes a documented command gets the command, not "unrecognized arguments".

ROOT = DOCS.parent
FENCE = re.compile(r"^```(?!python)[^\n]*\n(.*?)^```", re.S | re.M)  # Python is run above, not parsed
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # a span may wrap onto the next line
# where a command starts: a line's start, after ``$ ``, ``&&``, ``|`` or ``;``, after
# VAR=value assignments and a path to the executable, or as ``python -m prefixcache.cli``
COMMAND = re.compile(
    r"(?:^[ \t]*|[;&|][ \t]*|\$[ \t]+|-m[ \t]+)(?:[A-Z_][A-Z0-9_]*=\S*[ \t]+)*(?:[\w./-]*/)?"
    r"prefixcache(?:\.cli)?[ \t]+([a-z][a-z-]*)([^\n]*)",
    re.M,
)
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
MAKE = re.compile(r"\bmake[ \t]+([a-z][a-z0-9-]*)")
PATH = re.compile(r"\b((?:benchmarks|tests|docs)/[\w./-]+\.(?:py|md))")
COMMAND_END = re.compile(r"\s(?:#|\||&&|;|&|>)")


def subcommands() -> dict[str, set[str]]:
    """Each subcommand of the real ``prefixcache`` parser and the options it accepts."""
    from prefixcache.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def code_spans(text: str) -> list[tuple[int, str]]:
    """(offset, text) of every code block (continuation lines joined) and inline code span."""
    spans = [(m.start(1), m.group(1).replace("\\\n", "  ")) for m in FENCE.finditer(text)]
    prose = FENCE.sub(lambda m: " " * len(m.group(0)), text)  # offsets kept
    return spans + [(m.start(1), m.group(1).replace("\n", " ")) for m in INLINE.finditer(prose)]


def command_errors(name: str, text: str, known: dict[str, set[str]]) -> list[str]:
    """Where ``text`` (the page ``name``) names a subcommand or a flag that does not exist."""
    errors = []
    for offset, span in code_spans(text):
        for m in COMMAND.finditer(span):
            line = text.count("\n", 0, offset + m.start()) + 1
            sub, rest = m.group(1), COMMAND_END.split(m.group(2))[0]
            if sub not in known:
                errors.append(f"{name}:{line}: `prefixcache {sub}`: no such subcommand")
                continue
            for flag in FLAG.findall(rest):
                if flag not in known[sub]:
                    errors.append(f"{name}:{line}: `prefixcache {sub} {flag}`: no such flag")
    return errors


def make_targets() -> set[str]:
    rule = re.compile(r"^([\w.-]+)\s*:(?!=)", re.M)
    return set(rule.findall((ROOT / "Makefile").read_text()))


def reference_errors(name: str, text: str, targets: set[str]) -> list[str]:
    """Where ``text`` names a make target or a file of the repository that does not exist."""
    errors = []
    for offset, span in code_spans(text):
        for m in MAKE.finditer(span):
            if m.group(1) not in targets:
                line = text.count("\n", 0, offset + m.start()) + 1
                errors.append(f"{name}:{line}: `make {m.group(1)}`: no such Makefile target")
    for m in PATH.finditer(text):
        if not (ROOT / m.group(1).rstrip(".")).exists():
            errors.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}: no such file")
    return errors


PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_every_documented_command_flag_target_and_path_exists(page: str) -> None:
    text = (ROOT / page).read_text()
    errors = command_errors(page, text, subcommands()) + reference_errors(page, text, make_targets())
    if page != "README.md":  # make targets are checked in the README, where the quick start is
        errors = [e for e in errors if "Makefile target" not in e]
    assert not errors, "\n".join(errors)


def test_the_checker_reports_a_planted_flag_subcommand_target_and_path() -> None:
    known = subcommands()
    fake = (
        "Run it:\n\n```sh\nprefixcache serve --port 8001 \\\n  --no-such-flag\n```\n\n"
        "and `prefixcache teleport --fast`, `prefixcache plan TRACE --target-hit-rate 0.8`,\n"
        "`make serve`, `make fly`, benchmarks/bench_nothing.py, docs/cache.md.\n"
    )
    errors = command_errors("fake.md", fake, known) + reference_errors("fake.md", fake, make_targets())
    assert errors == [
        "fake.md:4: `prefixcache serve --no-such-flag`: no such flag",
        "fake.md:8: `prefixcache teleport`: no such subcommand",
        "fake.md:9: `make fly`: no such Makefile target",
        "fake.md:9: benchmarks/bench_nothing.py: no such file",
    ], errors
