"""Scripted agent episodes for ``dsec demo``: real code, real tests, in real sandboxes.

Each episode behaves like a coding agent: write a solution and its tests, run the
solution, run the tests, read the results file; a third of the episodes start from a
buggy attempt, see the failing test, "fix" the code and re-run. Every tool call is an
SDK call timed end to end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

TASKS: dict[str, dict[str, str]] = {
    "primes": {
        "good": "def solve(n):\n    sieve = [True] * (n + 1)\n    out = []\n    for i in range(2, n + 1):\n"
                "        if sieve[i]:\n            out.append(i)\n            for j in range(i * i, n + 1, i):\n"
                "                sieve[j] = False\n    return out\n",
        "bad": "def solve(n):\n    return [i for i in range(2, n) if all(i % d for d in range(2, i))]\n",
        "test": "    def test_small(self):\n        self.assertEqual(solve(13), [2, 3, 5, 7, 11, 13])\n"
                "    def test_count(self):\n        self.assertEqual(len(solve(10000)), 1229)\n",
        "arg": "100",
    },
    "fib": {
        "good": "def solve(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "bad": "def solve(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "test": "    def test_values(self):\n        self.assertEqual([solve(i) for i in range(8)], [0, 1, 1, 2, 3, 5, 8, 13])\n"
                "    def test_big(self):\n        self.assertEqual(solve(90), 2880067194370816120)\n",
        "arg": "50",
    },
    "wordcount": {
        "good": "import collections\n\ndef solve(text):\n"
                "    return dict(collections.Counter(w.lower().strip('.,!?') for w in text.split()))\n",
        "bad": "def solve(text):\n    out = {}\n    for w in text.split():\n        out[w] = out.get(w, 0) + 1\n"
               "    return out\n",
        "test": "    def test_case(self):\n        self.assertEqual(solve('The cat. the CAT!'), {'the': 2, 'cat': 2})\n",
        "arg": "'to be or not to be'",
    },
    "mergesort": {
        "good": "def solve(xs):\n    if len(xs) <= 1:\n        return list(xs)\n    m = len(xs) // 2\n"
                "    a, b = solve(xs[:m]), solve(xs[m:])\n    out = []\n    while a and b:\n"
                "        out.append(a.pop(0) if a[0] <= b[0] else b.pop(0))\n    return out + a + b\n",
        "bad": "def solve(xs):\n    return sorted(set(xs))\n",
        "test": "    def test_dupes(self):\n        self.assertEqual(solve([3, 1, 3, 2]), [1, 2, 3, 3])\n"
                "    def test_random(self):\n        import random\n        xs = [random.randint(0, 99) for _ in range(500)]\n"
                "        self.assertEqual(solve(xs), sorted(xs))\n",
        "arg": "[5, 2, 9, 1, 5]",
    },
}

# Every episode's sandbox size; the demo keeps a warm pool of exactly this shape.
EPISODE_SHAPE: dict[str, Any] = {"cpu": 0.5, "memory": "256M", "timeout": 600}


def solution_file(task: str, buggy: bool) -> str:
    t = TASKS[task]
    body = t["bad"] if buggy else t["good"]
    return body + f"\n\nif __name__ == '__main__':\n    print('{task}:', solve({t['arg']}))\n"


def unittest_file(task: str) -> str:
    return ("import unittest\nfrom solution import solve\n\n\nclass T(unittest.TestCase):\n" + TASKS[task]["test"]
            + "\n\nif __name__ == '__main__':\n    unittest.main()\n")


@dataclass
class EpisodeResult:
    index: int
    task: str
    sandbox_id: str | None = None
    start_s: float | None = None
    tool_calls: int = 0
    exec_s: list[float] = field(default_factory=list)
    attempts: int = 0
    passed: bool = False
    error: str | None = None
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


async def run_episode(index: int, image: str, run_id: str, client: Any, on_step: Any = None) -> EpisodeResult:
    """One agent episode; never raises (failures are recorded and reported)."""
    from dsec.sdk import AsyncSandbox

    task = list(TASKS)[index % len(TASKS)]
    res = EpisodeResult(index=index, task=task)
    t_start = time.perf_counter()

    async def call(what: str, coro: Any) -> Any:
        t0 = time.perf_counter()
        out = await coro
        dt = time.perf_counter() - t0
        res.tool_calls += 1
        if what == "exec":
            res.exec_s.append(dt)
        if on_step:
            on_step(index, what)
        return out

    sb = None
    try:
        t0 = time.perf_counter()
        # No .pyc: a rewritten solution.py of the same size within the same second would
        # otherwise be shadowed by its stale bytecode (mtime+size check) — a real agent gotcha.
        sb = await AsyncSandbox.create(image=image, **EPISODE_SHAPE, client=client,
                                       env={"PYTHONDONTWRITEBYTECODE": "1"},
                                       labels={"demo": run_id, "task": task})
        res.start_s = time.perf_counter() - t0
        res.sandbox_id = sb.id
        if on_step:
            on_step(index, "create")
        buggy = index % 3 == 1
        await call("write", sb.files.write("/work/test_solution.py", unittest_file(task)))
        while res.attempts < 2:
            res.attempts += 1
            await call("write", sb.files.write("/work/solution.py", solution_file(task, buggy)))
            run = await call("exec", sb.exec("python3 solution.py", cwd="/work", timeout=60))
            if run.exit_code != 0:
                raise RuntimeError(f"solution crashed: {run.stderr.strip()[-200:]}")
            test = await call("exec", sb.exec("python3 -m unittest -v test_solution > result.txt 2>&1",
                                              cwd="/work", timeout=120))
            report = (await call("read", sb.files.read("/work/result.txt"))).decode(errors="replace")
            if test.exit_code == 0 and report.rstrip().endswith("OK"):
                res.passed = True
                break
            buggy = False  # the agent "reads the failure" and writes the fixed version
        if not res.passed:
            res.error = "tests still failing after the fix: " + report.strip().splitlines()[-1][:200]
    except Exception as e:  # noqa: BLE001 - an episode failure is data for the report
        res.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        if sb is not None:
            try:
                await sb.kill()
            except Exception as e:  # noqa: BLE001
                res.error = res.error or f"kill failed: {e}"
        res.wall_s = time.perf_counter() - t_start
    return res
