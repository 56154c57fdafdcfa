"""The guides' Python runs as written: every ```python block of docs/cache.md and
docs/storage.md, in order, in one namespace per page (as a reader would paste them),
in a scratch directory. A ``print`` line carries ``# -> TEXT``: what it prints
(``...`` stands for anything; two spaces and a parenthesis start a remark)."""

from __future__ import annotations

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
