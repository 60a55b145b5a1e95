"""Answer extraction: the official Video-MME script's behaviour (quirks included) and lvx's strict
mode."""

import re

import pytest

from lvx_app.eval.extract import (
    OFFICIAL_PREFIXES,
    counts_in_denominator,
    extract,
    extract_official,
    extract_strict,
)

# (model output, official letter, strict letter); "" = unparsed.
TABLE = [
    ("B", "B", "B"),
    ("B.", "B", "B"),
    (" C\n", "C", "C"),
    ("(D)", "D", "D"),
    ("A. Black.", "A", "A"),
    ("**C**", "C", "C"),
    ("**B.**", "B", "B"),
    ("(B) The man opens the door.", "B", "B"),
    ("D) 5 times", "D", "D"),
    ("The best answer is: C", "C", "C"),
    ("The best answer is C.", "C", "C"),
    ("The correct answer is (B).", "B", "B"),
    ("The answer is D", "D", "D"),
    ("Answer: A", "A", "A"),
    ("answer: B", "B", "B"),
    ("Option: D", "D", "D"),
    ("The correct option is: C", "C", "C"),
    # Missing commas: "The best option is" and "Best answer:" alone are never removed, so the
    # capital B of "Best" wins, and "The best option is C" keeps working only because "The" has no
    # A-D capital.
    ("Best answer: A", "B", "A"),
    ("Best option: D", "B", "D"),
    ("The best option is C", "C", "C"),
    ("The best option isThe correct option is D", "D", "D"),
    ("Best answer:Best option: C", "C", "C"),
    # First capital A-D anywhere: chatty openings read as letters in the official script.
    ("Based on the video, the answer is C.", "B", "C"),
    ("During the video the man scores twice, so C.", "D", ""),
    ("Actually, I think it is B.", "A", ""),
    ("A man is walking his dog.", "A", ""),
    ("I think the answer is c", "", ""),
    ("It is hard to say from these frames.", "", ""),
    ("", "", ""),
    ("   ", "", ""),
    (
        "I cannot determine which option is correct from the given frames of the video, sorry.",
        "",
        "",
    ),
    (
        "Sorry, I cannot determine what is correct from the given frames of this video at all.",
        "",
        "",
    ),
    ("!!!!!!!!!!!!!!!!", "", ""),
    ("C. 3\nD. 4", "C", "C"),
    ("Options (A) and (C) are close, but (C) fits better.", "A", ""),
    ("(A) or (B)", "A", ""),
    ("A or B", "A", ""),
    ("The answer is A or B.", "A", ""),
    ("B, C", "B", ""),
    ("The video shows a red car\nB", "B", "B"),
    ("The woman is holding a cup.\nC", "C", "C"),
    ("answer is B, final answer: D", "B", "D"),
]


@pytest.mark.parametrize("response, official, strict", TABLE)
def test_extraction_table(response, official, strict):
    assert extract_official(response) == official
    assert extract_strict(response) == strict
    assert extract(response, "official") == official and extract(response, "strict") == strict


def test_prefix_list_has_the_two_glued_entries():
    assert "The best option isThe correct option is" in OFFICIAL_PREFIXES
    assert "Best answer:Best option:" in OFFICIAL_PREFIXES
    assert "The best option is" not in OFFICIAL_PREFIXES and "Best answer:" not in OFFICIAL_PREFIXES


def _reference_official(s):
    """The official function as published (same logic, written out), to cross-check on random
    text."""
    s = s.strip()
    answer_prefixes = [
        "The best answer is", "The correct answer is", "The answer is", "The answer",
        "The best option is" "The correct option is", "Best answer:" "Best option:",
        "Answer:", "Option:", "The correct answer", "The correct option",
    ]  # fmt: skip
    for answer_prefix in answer_prefixes:
        s = s.replace(answer_prefix, "")
    if len(s.split()) > 10 and not re.search("[ABCD]", s):
        return ""
    matches = re.search(r"[ABCD]", s)
    if matches is None:
        return ""
    return matches[0]


def test_official_matches_reference_on_random_replies():
    import random

    rng = random.Random(0)
    words = [
        "The",
        "answer",
        "is",
        "Best",
        "option:",
        "A",
        "B.",
        "(C)",
        "d",
        "video",
        "Answer:",
        "correct",
        "\n",
    ]
    for _ in range(2000):
        reply = " ".join(rng.choice(words) for _ in range(rng.randint(0, 14)))
        assert extract_official(reply) == _reference_official(reply), reply


def test_denominator_rules():
    assert counts_in_denominator("B", "official") and counts_in_denominator("B", "strict")
    assert not counts_in_denominator("", "official")
    assert counts_in_denominator("", "strict")
    with pytest.raises(ValueError, match="scoring"):
        extract("B", "lenient")
