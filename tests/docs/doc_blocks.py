"""Fenced code blocks of README.md and docs/*.md, as the doc tests see them.

Rules (checked by test_doc_blocks.py):
- every fenced block names its language (```bash, ```python, ```text, ```yaml, ...);
- every ``bash``/``sh``/``shell`` and ``python`` block runs against a real server, unless
  the nearest non-blank line before it is ``<!-- not-run: REASON -->`` (REASON required);
- placeholders the text spells out are substituted (``PLACEHOLDERS`` below).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^`\s]*)")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->\s*$")

# What the docs say a placeholder stands for, and what the test puts there.
PLACEHOLDERS = {
    "SB_ID": "a live sandbox of yours (README: 'as printed by `dsec run --keep`')",
    "10.0.0.5:8080": "a web server of yours (README: 'stands for a web server of yours')",
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        return "shell" if self.lang in SHELL else "python" if self.lang in PYTHON else "other"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[0] * len(fence)):
            j += 1
        body = "\n".join(x.removeprefix(indent) for x in lines[i + 1:j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = NOT_RUN.match(lines[k].strip()) if k >= 0 else None
        out.append(Block(path, i + 1, lang, body + "\n", marker.group(1) if marker else None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in parse(f)]
