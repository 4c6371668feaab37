"""The process tree as /proc shows it now (one pass over /proc, no library)."""

from __future__ import annotations

from pathlib import Path


def descendants(roots: list[int], proc: Path = Path("/proc")) -> list[int]:
    """``roots`` and every live process below them, sorted."""
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(roots), list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return sorted(out)
