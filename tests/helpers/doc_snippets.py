"""The fenced Python snippets of README.md and docs/*.md, and a script that runs them.

A snippet is a ```python block. It is *runnable* unless its first line is a comment that
starts with `# not run` (a fragment such as `...` in a class body, or code that needs a
machine the tests do not have), and it runs verbatim: the snippets of one page run in order
in one namespace (a reader pasting them into one session), each page in a fresh one, in the
directory where the README's main job ran (`runs/fno_darcy`, `data/darcy_g64.h5`, and
`exported/` made by the README's `spmd export runs/fno_darcy exported/`). A block indented
inside a list item is dedented, as Markdown renders it.

`pages_script()` is the program that runs them all (tests/multiprocess/test_main_job.py
runs it with `python -c` in the main job's directory); it prints one line per snippet and
fails naming the page and line of the first snippet that raises.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.env import REPO

NOT_RUN = "# not run"
_BLOCK = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    page: str          # path relative to the repository root
    line: int          # line of the opening fence (1-based)
    code: str          # dedented
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages(root: Path = REPO) -> list[Path]:
    """README.md and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def snippets(page: Path, root: Path = REPO) -> list[Snippet]:
    """Every ```python block of `page`, in order."""
    text = page.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        code = textwrap.dedent(m.group(2))
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        found.append(Snippet(str(page.relative_to(root)), text.count("\n", 0, m.start()) + 1,
                             code, not first.startswith(NOT_RUN)))
    return found


def all_snippets(root: Path = REPO) -> list[Snippet]:
    return [s for page in doc_pages(root) for s in snippets(page, root)]


_RUNNER = """
import json, sys, traceback
pages = json.loads(sys.argv[1])
for page, blocks in pages.items():
    scope = {"__name__": "__doc__"}
    for where, code in blocks:
        try:
            exec(compile(code, where, "exec"), scope)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"doc snippet {where} failed (run verbatim, after the page's earlier ones)")
        print("ran", where, flush=True)
"""


def pages_script(root: Path = REPO) -> tuple[str, str]:
    """(program, argument): `python -c PROGRAM ARGUMENT` runs every runnable snippet."""
    pages: dict[str, list[tuple[str, str]]] = {}
    for s in all_snippets(root):
        if s.runnable:
            pages.setdefault(s.page, []).append((s.where, s.code))
    return _RUNNER, json.dumps(pages)
