"""How a checkpoint's processor writes media into the prompt, read from the checkpoint's own
processor files, else the published default of its release.

The released processors differ in three rules (reference mplug_owl3.md §5.3, §5.4, §10.1):

| release (form) | a video's frames | a still image beside a video | cut prompt |
|---|---|---|---|
| 7B-240728 (`g1-gateproj`) | bare: one `<|image|>` each | never cut (cut is off) | `v2_global` |
| 1B/2B-241014 (`g1`) | in a span: one `<|image|>` each | cut as asked | `v3_global` |
| 7B-241101 (`g2`) | in a span | cut as asked | `v3_global` |

The span is `<|start_video_frame|>` before a video's placeholders and `<|end_video_frame|>` after.

A published checkpoint ships its processor as remote code. lvx reads it as text, never runs it:
- `processing_mplugowl3.py`: the video span is the `"use_video_span": True/False` of its video media
  entries; a file that handles `<|video|>` but never writes `<|start_video_frame|>` writes bare
  frames. A statement `cut_enable = False` on a line of its own turns cut off for the whole call
  when videos are present; `cut_enable=cut_enable` passed on to each image keeps the call's cut.
- `image_processing_mplugowl3.py`: the default `cut_cfg` (`cut_prompt`, `add_global`, `anchors`).
A rule the files do not state takes the default of the release the weights' form was published as;
`PromptRules.sources` says where each rule came from (`lvx info --model` shows it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .checkpoint import CheckpointError
from .published import RELEASE_OF_FORM

PROCESSING_FILE = "processing_mplugowl3.py"
IMAGE_PROCESSING_FILE = "image_processing_mplugowl3.py"
CUT_TEMPLATES = ("v2_global", "v3_global")  # the cut prompts `processor.CUT_PROMPTS` writes
CUT_ANCHORS = "grid_squ_6"  # the only anchor set `processor.select_cut_grid` knows

_SPAN = re.compile(r"""["']use_video_span["']\s*:\s*(True|False)""")
_CUT_OFF = re.compile(r"^[ \t]*cut_enable[ \t]*=[ \t]*False[ \t]*(?:#.*)?$", re.MULTILINE)
_CUT_PASSED_ON = re.compile(r"\bcut_enable\s*=\s*cut_enable\b")
_CUT_PROMPT = re.compile(r"""["']cut_prompt["']\s*:\s*["'](\w+)["']""")
_ADD_GLOBAL = re.compile(r"""["']add_global["']\s*:\s*(True|False)""")
_ANCHORS = re.compile(r"""["']anchors["']\s*:\s*["'](\w+)["']""")


@dataclass(frozen=True)
class PromptRules:
    """The three rules that differ between the released processors. `sources` maps each rule's name
    to where it came from: a processor file or a published default."""

    video_span: bool  # <|start_video_frame|> ... <|end_video_frame|> around a video's frames
    cut_beside_video: bool  # still images keep the call's cut when the call has a video
    cut_template: str  # "v2_global" | "v3_global"
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def describe(self) -> dict[str, str]:
        """One line per rule, with its source (`lvx info --model`)."""
        video = (
            "<|start_video_frame|> + <|image|> per frame + <|end_video_frame|>"
            if self.video_span
            else "<|image|> per frame, no span"
        )
        beside = "cut as asked" if self.cut_beside_video else "never cut (cut off for the call)"
        return {
            "video prompt": f"{video} ({self.sources.get('video_span', '?')})",
            "images beside a video": f"{beside} ({self.sources.get('cut_beside_video', '?')})",
            "cut prompt": f"{self.cut_template} ({self.sources.get('cut_template', '?')})",
        }


_PUBLISHED = {
    "g1-gateproj": PromptRules(video_span=False, cut_beside_video=False, cut_template="v2_global"),
    "g1": PromptRules(video_span=True, cut_beside_video=True, cut_template="v3_global"),
    "g2": PromptRules(video_span=True, cut_beside_video=True, cut_template="v3_global"),
}


def published_rules(form: str) -> PromptRules:
    """The rules of the release a checkpoint form was published as ("g1-gateproj", "g1", "g2")."""
    if form not in _PUBLISHED:
        raise ValueError(f"form must be one of {', '.join(_PUBLISHED)}, not {form!r}")
    source = f"published default of {RELEASE_OF_FORM[form]}"
    names = ("video_span", "cut_beside_video", "cut_template")
    return replace(_PUBLISHED[form], sources=dict.fromkeys(names, source))


def _one(pattern: re.Pattern, text: str) -> str | None:
    """The value the pattern captures, when every match agrees; else None (not stated)."""
    values = set(pattern.findall(text))
    return values.pop() if len(values) == 1 else None


def video_span_in(text: str) -> bool | None:
    """The video span a processing_mplugowl3.py text writes, or None if it does not say."""
    span = _one(_SPAN, text)
    if span is not None:
        return span == "True"
    if "<|video|>" in text and "<|start_video_frame|>" not in text:
        return False
    return None


def cut_beside_video_in(text: str) -> bool | None:
    """Whether a processing_mplugowl3.py text keeps the call's cut for images beside videos."""
    if _CUT_OFF.search(text):
        return False
    return True if _CUT_PASSED_ON.search(text) else None


def cut_template_in(text: str, where: str = IMAGE_PROCESSING_FILE) -> str | None:
    """The cut prompt of an image_processing_mplugowl3.py text's `cut_cfg`; refuses ones lvx cannot
    write."""
    anchors = _one(_ANCHORS, text)
    if anchors is not None and anchors != CUT_ANCHORS:
        raise CheckpointError(
            f"{where} cuts images with anchors {anchors!r}; only {CUT_ANCHORS} is implemented"
        )
    prompt = _one(_CUT_PROMPT, text)
    if prompt is None:
        return None
    name = prompt + ("_global" if _one(_ADD_GLOBAL, text) == "True" else "")
    if name not in CUT_TEMPLATES:
        raise CheckpointError(
            f"{where} uses cut prompt {name!r}; only {', '.join(CUT_TEMPLATES)} are implemented"
        )
    return name


def read_prompt_rules(directory: Path, form: str) -> PromptRules:
    """Each rule from the checkpoint's processor files where they state it, else the published
    default of `form`."""
    rules = published_rules(form)
    found: dict[str, object] = {}
    sources = dict(rules.sources)
    processing = Path(directory) / PROCESSING_FILE
    if processing.is_file():
        text = processing.read_text(errors="replace")
        found["video_span"] = video_span_in(text)
        found["cut_beside_video"] = cut_beside_video_in(text)
    image_processing = Path(directory) / IMAGE_PROCESSING_FILE
    if image_processing.is_file():
        found["cut_template"] = cut_template_in(image_processing.read_text(errors="replace"))
    stated = {name: value for name, value in found.items() if value is not None}
    for name in stated:
        sources[name] = IMAGE_PROCESSING_FILE if name == "cut_template" else PROCESSING_FILE
    for name in set(found) - set(stated):
        file = IMAGE_PROCESSING_FILE if name == "cut_template" else PROCESSING_FILE
        sources[name] += f" ({file} does not say)"
    return replace(rules, **stated, sources=sources)


def differences(rules: PromptRules, form: str) -> list[str]:
    """A line for each rule that differs from the published default of `form` (loader notes)."""
    default = published_rules(form)
    release = RELEASE_OF_FORM[form]
    lines = rules.describe()
    names = {
        "video_span": "video prompt",
        "cut_beside_video": "images beside a video",
        "cut_template": "cut prompt",
    }
    return [
        f"{label}: {lines[label]}, not the {release} default"
        for name, label in names.items()
        if getattr(rules, name) != getattr(default, name)
    ]
