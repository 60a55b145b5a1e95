"""--speech-language is checked with the other options, before any rank or model starts: a name
where a code belongs (english) is one line listing Whisper's codes, on every frontend."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lvx_app.cli.main import app
from lvx_app.config import ConfigError, VideoConfig

pytest.importorskip("faster_whisper")


def test_a_language_name_is_refused_in_one_line_naming_the_codes(tmp_path, short_video):
    result = CliRunner().invoke(
        app, ["chat", short_video, "--speech-language", "english", "--model", str(tmp_path)]
    )
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: --speech-language takes"), lines
    assert "'english'" in lines[0] and ", en, " in lines[0] and ", fr, " in lines[0]


def test_the_python_api_refuses_it_too_and_takes_a_code():
    with pytest.raises(ConfigError, match=r"^--speech-language takes a Whisper language code"):
        VideoConfig(speech_language="english")
    assert VideoConfig(speech_language="fr").speech_language == "fr"
