"""Answer extraction and scoring modes for multiple-choice replies.

``official`` reproduces Video-MME's ``eval_your_results.py`` bit for bit, quirks included:

* the prefix list has two missing commas, so Python glues "The best option is" + "The correct option
  is" and "Best answer:" + "Best option:" into single strings; those phrases alone are never
  removed;
* the extracted letter is the *first capital A-D anywhere* in what is left ("Based on ..." reads as
  B);
* a reply with no letter is *unparsed* and dropped from the denominator.

``strict`` follows lmms-eval's choice that an unparsed reply is simply wrong (every question asked
counts), and accepts only a letter that is given as an answer: a bare letter, a leading label ("B.",
"(B)", "B)"), an explicit declaration ("The answer is B"), a lone parenthesised letter or a lone
letter on the last line. Letters inside prose ("A man walks ...") are not answers. Conflicting
candidates leave the reply unparsed.
"""

from __future__ import annotations

import re

SCORING_MODES = ("official", "strict")
LETTERS = "ABCD"

# Order and content exactly as the official script evaluates them (adjacent literals concatenated).
OFFICIAL_PREFIXES: tuple[str, ...] = (
    "The best answer is",
    "The correct answer is",
    "The answer is",
    "The answer",
    "The best option isThe correct option is",  # noqa: ISC001 - the official missing comma
    "Best answer:Best option:",  # noqa: ISC001 - the official missing comma
    "Answer:",
    "Option:",
    "The correct answer",
    "The correct option",
)

_ANY_LETTER = re.compile(r"[ABCD]")


def extract_official(response: str) -> str:
    """The official Video-MME extraction: a letter A-D, or "" when the reply is unparsed."""
    s = (response or "").strip()
    for prefix in OFFICIAL_PREFIXES:
        s = s.replace(prefix, "")
    if len(s.split()) > 10 and not _ANY_LETTER.search(s):
        return ""
    match = _ANY_LETTER.search(s)
    return match[0] if match else ""


# Strict extraction. A letter "stands alone" when neither side touches a word character.
_L = r"(?<![\w'])\(?\*{0,2}([A-D])\*{0,2}\)?(?![\w'])"
_DECLARATION = re.compile(
    r"(?:\b(?:the|my)\s+)?(?:\b(?:correct|best|final|right)\s+)?\b(?:answer|option|choice)\b\s*(?:is\b\s*:?|:|=)\s*"
    r"(?:option\s+|choice\s+)?" + _L,
    re.IGNORECASE,
)
_LEADING = re.compile(r"[\s*\[(]*([A-D])(?![\w'])")
# "A or B", "(A)/(B)"
_ALTERNATIVE = re.compile(r"[\s.):\]*]*(?:or|and|/|,|&)\s*[\s(\[*]*[A-D](?![\w'])")
_PAREN = re.compile(r"(?<!\w)\(([A-D])\)(?!\w)")
_LAST_LINE = re.compile(r"^[\s*\[(]*([A-D])[\s*\]).]*$")


def extract_strict(response: str) -> str:
    """A letter A-D only when the reply gives it as an answer; "" otherwise (scored wrong)."""
    text = (response or "").strip()
    if not text:
        return ""
    declared = [m for m in _DECLARATION.finditer(text) if m.group(1) in LETTERS]
    if declared:  # the last explicit declaration wins ("Answer: B ... final answer: C")
        last = declared[-1]
        return "" if _ALTERNATIVE.match(text, last.end()) else last.group(1)
    lead = _LEADING.match(text)
    if lead and _ALTERNATIVE.match(text, lead.end()):
        return ""
    if lead:
        rest = text[lead.end() :]
        if not rest.strip(" \t\n*.):]"):  # "B", "(B)", "**B.**"
            return lead.group(1)
        tail = rest.lstrip("*]")
        if tail[:1] in ".):" and (
            len(tail) == 1 or tail[1] in " \t\n*"
        ):  # "B. Black.", "(B) Black", "B: ..."
            return lead.group(1)
    parens = {m.group(1) for m in _PAREN.finditer(text)}
    if len(parens) == 1:
        return parens.pop()
    if len(parens) > 1:
        return ""
    final = _LAST_LINE.match(text.splitlines()[-1])
    return final.group(1) if final else ""


def extract(response: str, scoring: str) -> str:
    """The letter A-D that ``scoring`` reads in ``response``, or "" when unparsed."""
    if scoring == "official":
        return extract_official(response)
    if scoring == "strict":
        return extract_strict(response)
    raise ValueError(f"unknown scoring mode {scoring!r}: use one of {', '.join(SCORING_MODES)}")


def counts_in_denominator(pred: str, scoring: str) -> bool:
    """Whether a reply counts towards accuracy: official drops unparsed replies, strict counts them
    wrong."""
    return bool(pred) or scoring == "strict"
