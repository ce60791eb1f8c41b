r"""MATH scorer: the last ``\boxed{...}`` answer, compared after the usual string normalisation.

The normalisation is the "is_equiv" convention of the Hendrycks MATH evaluation that verl uses (strip
spaces, ``\left``/``\right``, ``\!``, units, degrees, ``dfrac``/``tfrac``, bare ``\frac12`` and ``a/b``).
Beyond it: thousands separators, ``\text{..}`` wrappers and a trailing full stop are dropped, and two plain
numbers (integers, decimals, ``\frac{p}{q}``, ``p/q``) are compared as exact fractions, so ``0.25`` equals
``\frac{1}{4}``. No symbolic algebra: ``\frac{\sqrt{2}}{2}`` and ``\frac{1}{\sqrt{2}}`` stay different.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed_answer(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (nested braces allowed) or ``\boxed x``; None if absent/unclosed."""
    for command in _BOX_COMMANDS:
        start = text.rfind(command)
        if start >= 0:
            break
    else:
        return None
    rest = text[start + len(command) :]
    if rest.startswith(" "):
        # "\boxed 5$": the answer runs to the closing dollar (or the end of the text).
        return rest[1:].split("$")[0].strip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the response was cut off inside the box


_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")
_TRAILING_UNIT = re.compile(r"^(.*\d)\\(?:text|mbox|mathrm)\{[^{}]*\}$")
_SQRT_BARE = re.compile(r"\\sqrt([^{\s\\])")
_FRAC_BARE_BARE = re.compile(r"\\frac([^{\s\\])([^{\s\\])")
_FRAC_BARE_BRACED = re.compile(r"\\frac([^{\s\\])\{")
_FRAC_BRACED_BARE = re.compile(r"\\frac(\{[^{}]*\})([^{\s\\])")
_SLASH = re.compile(r"(-?\d+)/(\d+)")
_INTEGER = re.compile(r"[-+]?\d+")
# int() refuses strings of more than 4300 digits; answers that long are never plain numbers worth parsing.
_MAX_NUMBER_CHARS = 1000


def _drop_units(text: str) -> str:
    r"""``5\text{ cm}`` -> ``5``: a ``\text{ `` with a leading space only ever holds units in MATH."""
    for command in ("\\text{ ", "\\mbox{ "):
        if command in text:
            text = text.split(command)[0]
    text = _TRAILING_UNIT.sub(r"\1", text)  # 5\text{cm}
    return _TEXT_WRAPPER.sub(r"\1", text)  # \text{(A)} -> (A)


def _fix_fracs(text: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{72}`` -> ``\frac{1}{72}``, ``\frac{72}1`` -> ``\frac{72}{1}``."""
    text = _FRAC_BARE_BARE.sub(r"\\frac{\1}{\2}", text)
    text = _FRAC_BARE_BRACED.sub(r"\\frac{\1}{", text)
    return _FRAC_BRACED_BARE.sub(r"\\frac\1{\2}", text)


def strip_string(text: str) -> str:
    """Normalise a LaTeX answer so that equal answers written differently compare equal as strings."""
    text = text.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    text = text.replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "").replace("$", "")
    text = _drop_units(text)
    text = text.replace("\\%", "").replace("%", "")
    # ".5" and "{.5" mean 0.5; give them the leading zero the ground truth has.
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    # "k = 5" -> "5": a short left-hand side is a variable name, not part of the answer.
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        text = sides[1]
    text = _SQRT_BARE.sub(r"\\sqrt{\1}", text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    text = text.rstrip(".")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    slash = _SLASH.fullmatch(text)
    if slash:
        text = f"\\frac{{{slash.group(1)}}}{{{slash.group(2)}}}"
    if len(text) <= _MAX_NUMBER_CHARS and _INTEGER.fullmatch(text):
        # "007" -> "7", "+3" -> "3"
        text = str(int(text))
    return text


_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")
_FRAC = re.compile(r"([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}")


def as_fraction(text: str) -> Fraction | None:
    r"""The exact value of a normalised plain number (``12``, ``-0.25``, ``\frac{3}{4}``), else None."""
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    if _DECIMAL.fullmatch(text):
        return Fraction(text)
    frac = _FRAC.fullmatch(text)
    if frac and int(frac.group(3)) != 0:
        value = Fraction(int(frac.group(2)), int(frac.group(3)))
        return -value if frac.group(1) == "-" else value
    return None


def is_equiv(answer: str, ground_truth: str) -> bool:
    """Equal after normalisation, or the same plain number."""
    left, right = strip_string(answer), strip_string(ground_truth)
    if left == right:
        return True
    left_value, right_value = as_fraction(left), as_fraction(right)
    return left_value is not None and left_value == right_value


def compute_score(solution_str: str, ground_truth: str | int | float) -> float:
    r"""1.0 when the last ``\boxed{}`` answer is equivalent to the ground truth, else 0.0."""
    answer = extract_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    # Some datasets keep the whole "\boxed{...}" as the ground truth.
    boxed_truth = extract_boxed_answer(truth) if "\\boxed" in truth else None
    return 1.0 if is_equiv(answer, truth if boxed_truth is None else boxed_truth) else 0.0
