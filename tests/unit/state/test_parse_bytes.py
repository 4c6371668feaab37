"""Sizes given by users parse to bytes or fail with a ValueError naming the input."""

from __future__ import annotations

import pytest

from dsec.config import parse_bytes


@pytest.mark.parametrize("text,want", [("512M", 512 << 20), ("8G", 8 << 30), ("1.5g", 3 << 29), ("1024", 1024),
                                       ("2GiB", 2 << 30), (4096, 4096)])
def test_sizes_parse(text: str | int, want: int) -> None:
    """Unit suffixes (with or without iB/B) and plain integers are accepted."""
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad", ["", "x", "-1G", "nan", "inf", "1" + "0" * 400 + "G", -5])
def test_bad_sizes_are_value_errors(bad: str | int) -> None:
    """Garbage, negatives and non-finite sizes are ValueError (a 422 at the API), never an
    OverflowError (which would be a 500)."""
    with pytest.raises(ValueError, match="size"):
        parse_bytes(bad)
