"""Text every family's tokenizer takes, shared so the app checks it once for all of them."""

from __future__ import annotations


def valid_text(text: str) -> str:
    """`text` as valid Unicode: a lone surrogate (`"\\ud800"`, which Python strings and JSON may
    carry but no tokenizer takes) becomes U+FFFD; a pair written as two surrogates becomes its
    character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text
