"""The calc tool: exact integers, float repr, and refusals of anything but bounded arithmetic."""

from __future__ import annotations

import time

import pytest

from hybridflow.tools import CalcError, calc


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("123*45", "5535"),
        ("(12+3)*4/5", "12.0"),
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("2**100", "1267650600228229401496703205376"),
        ("0.1+0.2", "0.30000000000000004"),
        ("-(3 - 5)", "2"),
        ("2**-1", "0.5"),
        (" 1e3 ", "1000.0"),
    ],
)
def test_calc_results(expression: str, expected: str) -> None:
    assert calc(expression) == expected


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os')", "unsupported syntax"),
        ("2**10**10", "exponent"),
        ("9**9**9", "exponent"),
        ("10**5000", "too large"),
        ("(10**1000)*(10**1000)*(10**1000)", "too large"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2.0**5000", "too large for a float"),
        ("(-8)**0.5", "complex"),
        ("x + 1", "unsupported syntax: Name"),
        ("'a'*3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 <", "not a valid expression"),
        ("1 < 2", "unsupported syntax: Compare"),
        ("1+" * 600 + "1", "too long"),
    ],
)
def test_calc_refusals(expression: str, reason: str) -> None:
    start = time.monotonic()
    with pytest.raises(CalcError, match=reason):
        calc(expression)
    assert time.monotonic() - start < 1
