"""The OpenAI-compatible API of `lvx serve`, driven with the official `openai` package (and curl)
against a real server: 2 CPU ranks, the page on the same port, an API key.

The answers must be exactly the model's own greedy answers (test_engine's reference), a follow-up
must prefill only its new tokens, and every refusal must come back in OpenAI's error shape while
the server keeps serving.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_engine import PARAMS, QUESTIONS, _reference  # noqa: E402
from test_engine_chat import _greedy  # noqa: E402
from test_serve import start_server, stop_server  # noqa: E402

KEY = "sk-test-key"
MAX_UPLOAD_MB = 1


@pytest.fixture(scope="module")
def server(tiny_checkpoints, short_video, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_api")
    videos = root / "videos"
    videos.mkdir()
    shutil.copy(short_video, videos / "short.mp4")
    (videos / "junk.mp4").write_bytes(b"not a video at all " * 100)
    log = root / "serve.log"
    args = [
        *("--gpus", "0", "--ranks", "2", "--model", tiny_checkpoints["g2"]),
        *("--cache-dir", str(root / "cache"), "--allow-paths", str(videos)),
        *("--max-upload-mb", str(MAX_UPLOAD_MB), "--max-new-tokens", str(PARAMS.max_new_tokens)),
        *("--api-key", KEY, "--queue-size", "1"),
        *("--rank-memory-gib", "1024"),  # the model's context, not the free memory, caps a question
    ]
    proc, url = start_server(args, log)
    yield type("Server", (), dict(url=url, videos=videos, log=log, root=root, proc=proc))
    stop_server(proc, log)
    assert "Traceback" not in log.read_text(errors="replace")


@pytest.fixture(scope="module")
def expected(tiny_checkpoints, short_video) -> list[str]:
    return _reference(tiny_checkpoints["g2"], short_video)


def client(server, key: str = KEY):
    return openai.OpenAI(base_url=server.url + "v1", api_key=key, max_retries=0, timeout=300)


def video_message(url: str, question: str = QUESTIONS[0]) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": question},
        ],
    }


def streamed(stream) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of a streamed answer."""
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def log_lines(server) -> list[str]:
    return [
        line
        for line in server.log.read_text(errors="replace").splitlines()
        if line.startswith("api:")
    ]


@pytest.mark.slow
def test_streaming_and_not_and_a_follow_up_that_reuses_the_prefix(server, expected):
    c = client(server)
    (model,) = c.models.list().data
    first = [video_message(f"file://{server.videos / 'short.mp4'}")]
    text, finish, usage = streamed(
        c.chat.completions.create(
            model=model.id, messages=first, stream=True, stream_options={"include_usage": True}
        )
    )
    assert text == expected[0] and finish in ("stop", "length")
    assert usage.completion_tokens <= PARAMS.max_new_tokens

    again = c.chat.completions.create(model=model.id, messages=first)
    assert again.choices[0].message.content == expected[0]
    assert again.usage.prompt_tokens == usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1

    follow = first + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    reply = c.chat.completions.create(model=model.id, messages=follow)
    assert reply.choices[0].message.content == expected[1]
    # only its new tokens were prefilled: the first answer's last token when it was cut short,
    # <|im_end|>, and the new user turn (counted by the server's tokenizer)
    from lvx_models.mplug_owl3.processor import Owl3Processor

    processor = Owl3Processor.from_pretrained(model.id)
    turn = processor.build_followup(QUESTIONS[1], offset=0).input_ids.numel()
    new = int(finish == "length") + 1 + turn
    held = usage.prompt_tokens + usage.completion_tokens - 1
    assert reply.usage.prompt_tokens == held + new
    assert reply.usage.prompt_tokens - reply.usage.prompt_tokens_details.cached_tokens == new
    assert f"prefilled {new} of {held + new} prompt tokens" in log_lines(server)[-1]


@pytest.mark.slow
def test_text_only_chat_and_generation_fields(server, tiny_checkpoints):
    c = client(server)
    hello = [{"role": "user", "content": "hello, who are you?"}]
    reply = c.chat.completions.create(model="any", messages=hello)
    assert reply.choices[0].message.content == _greedy(tiny_checkpoints["g2"], hello)
    short = c.chat.completions.create(model="any", messages=hello, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    full = reply.choices[0].message.content
    cut = full[2:4]
    stopped = c.chat.completions.create(model="any", messages=hello, stop=[cut])
    assert stopped.choices[0].message.content == full[: full.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    text, _, _ = streamed(
        c.chat.completions.create(model="any", messages=hello, stop=cut, stream=True)
    )
    assert text == full[: full.index(cut)]
    sampled = [
        c.chat.completions.create(
            model="any",
            messages=hello,
            temperature=1.5,
            top_p=0.9,
            seed=seed,
            max_completion_tokens=8,
        )
        .choices[0]
        .message.content
        for seed in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


@pytest.mark.slow
def test_extra_body_fps_and_a_video_sent_as_data(server, short_video, expected, tiny_checkpoints):
    c = client(server)
    by_path = [video_message(f"file://{server.videos / 'short.mp4'}")]
    one = c.chat.completions.create(model="m", messages=by_path, extra_body={"fps": 1})
    two = c.chat.completions.create(model="m", messages=by_path, extra_body={"fps": 2})
    from lvx_models.mplug_owl3.processor import Owl3Processor

    processor = Owl3Processor.from_pretrained(tiny_checkpoints["g2"])
    frame = processor.build_chat_prompt([{"role": "user", "content": "<|video|>"}], videos=[2])
    per_frame = (
        frame.input_ids.numel()
        - processor.build_chat_prompt(
            [{"role": "user", "content": "<|video|>"}], videos=[1]
        ).input_ids.numel()
    )
    assert two.usage.prompt_tokens - one.usage.prompt_tokens == 10 * per_frame  # 20 frames, not 10
    with open(short_video, "rb") as f:
        data = "data:video/mp4;base64," + base64.b64encode(f.read()).decode()
    sent = c.chat.completions.create(model="m", messages=[video_message(data)])
    assert sent.choices[0].message.content == expected[0]


def status_of(call) -> tuple[int, dict]:
    """(HTTP status, the error object) of a refused call."""
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.body
    return info.value.status_code, body.get("error", body) if isinstance(body, dict) else body


@pytest.mark.slow
def test_every_refusal_is_an_openai_error_and_the_server_goes_on(server, expected):
    c = client(server)
    video = f"file://{server.videos / 'short.mp4'}"
    ask = lambda messages, **kw: c.chat.completions.create(model="m", messages=messages, **kw)  # noqa: E731
    for call, code, says in (
        (lambda: client(server, "wrong").models.list(), 401, "API key"),
        (
            lambda: client(server, "wrong").chat.completions.create(model="m", messages=[]),
            401,
            "API key",
        ),
        (lambda: ask([video_message(video)], n=2), 400, "n must be 1"),
        (lambda: ask([video_message(video)], temperature=-1), 400, "temperature must be"),
        (lambda: ask([]), 400, "messages must be a non-empty list"),
        (lambda: ask([video_message("file:///etc/hostname")]), 400, "outside the allowed folders"),
        (lambda: ask([video_message(f"file://{server.videos / 'missing.mp4'}")]), 400, "not found"),
        (lambda: ask([video_message(f"file://{server.videos / 'junk.mp4'}")]), 400, "video"),
        (lambda: ask([video_message("https://example.com/a.mp4")]), 400, "file:///"),
        (lambda: ask([video_message(video)], extra_body={"fps": 0}), 400, "fps must be"),
        (lambda: ask([video_message(video, "why? " * 40_000)]), 400, "the model's context"),
    ):
        status, error = status_of(call)
        assert status == code and says in error["message"], (status, error)
        assert "\n" not in error["message"] and error["type"] and error["code"]
    raw = httpx.post(server.url + "v1/chat/completions", content=b"{nope", headers=_auth())
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    for size_mb in (1.5, 4):  # over --max-upload-mb: read and measured, or refused by its length
        data = "data:video/mp4;base64," + "A" * int(size_mb * 2**20 * 4 / 3)
        status, error = status_of(lambda: ask([video_message(data)]))
        assert status == 413 and "--max-upload-mb" in error["message"], error
    reply = ask([video_message(video)])
    assert reply.choices[0].message.content == expected[0]


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.mark.slow
def test_a_full_queue_is_429(server):
    """--queue-size 1: one request on the engine, one waiting; the others are turned away."""
    c = client(server)
    hello = [{"role": "user", "content": "count to a thousand"}]
    start, results = threading.Barrier(4), []

    def one() -> None:
        start.wait()
        try:
            c.chat.completions.create(model="m", messages=hello, max_tokens=200)
            results.append(200)
        except openai.APIStatusError as exc:
            results.append(exc.status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(200) >= 2 and 429 in results, results


@pytest.mark.slow
def test_curl_sees_server_sent_events(server, expected):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = {
        "model": "m",
        "messages": [video_message(f"file://{server.videos / 'short.mp4'}")],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = subprocess.run(
        [curl, "-sN", server.url + "v1/chat/completions", "-H", f"Authorization: Bearer {KEY}"]
        + ["-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", out
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2]), out
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_stops_its_answer(server, expected):
    c = client(server)
    hello = [{"role": "user", "content": "tell me a long story"}]
    before = len(log_lines(server))
    with c.chat.completions.create(
        model="m", messages=hello, stream=True, max_tokens=400
    ) as stream:
        for seen, _ in enumerate(stream):
            if seen == 3:
                break  # leaving the block closes the connection
    while len(log_lines(server)) == before:
        time.sleep(0.1)
    line = log_lines(server)[before]
    assert "stopped: the client went away" in line, line
    assert int(line.split()[1]) < 400, line
    reply = c.chat.completions.create(
        model="m", messages=[video_message(f"file://{server.videos / 'short.mp4'}")]
    )
    assert reply.choices[0].message.content == expected[0]


@pytest.mark.slow
def test_the_page_and_the_api_share_the_engine(server, expected):
    """The page is served on the same port; after the API used the engine, the page's tab rebuilds
    its conversation (as when another browser tab took the engine), and reloads its video when the
    API loaded another: its next answer is the one an uninterrupted conversation gives."""
    gradio_client = pytest.importorskip("gradio_client")
    from test_serve import ask as page_ask
    from test_serve import last_answer

    from lvx_app.engine.describe import printable
    from lvx_ui.app import link_timestamps

    def shown(text: str) -> str:  # as the page shows an answer
        return link_timestamps(printable(text), 10.0)

    assert "<html" in httpx.get(server.url).text.lower()
    assert httpx.get(server.url + "health").json() == {"status": "ok"}  # no path without the key
    health = httpx.get(server.url + "health", headers=_auth()).json()
    assert health["status"] == "ok" and "model" in health
    with pytest.raises(Exception):  # noqa: B017 - the key guards the page too
        gradio_client.Client(server.url, verbose=False)
    page = gradio_client.Client(server.url, verbose=False, auth=("anyone", KEY))
    status, _, _ = page.predict(None, str(server.videos / "short.mp4"), 1.0, 0, api_name="/load")
    history, _ = page_ask(page, QUESTIONS[0], [])
    assert last_answer(history)[0] == shown(expected[0])
    client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    history, _ = page_ask(page, QUESTIONS[1], history)
    answer, footer = last_answer(history)
    assert answer == shown(expected[1]), footer
    assert "conversation was rebuilt" in footer and "reloaded" not in footer, "the same video"
    video = video_message(f"file://{server.videos / 'short.mp4'}")
    client(server).chat.completions.create(model="m", messages=[video], extra_body={"fps": 2})
    history, _ = page_ask(page, QUESTIONS[0], [])
    answer, footer = last_answer(history)
    assert answer == shown(expected[0]) and "reloaded your video short.mp4" in footer, footer


@pytest.mark.slow
def test_a_dead_group_is_503_while_it_restarts(server, expected):
    """Runs last in the module: it kills rank 1 of the group."""
    c = client(server)
    video = [video_message(f"file://{server.videos / 'short.mp4'}")]
    c.chat.completions.create(model="m", messages=video)
    (pid,) = server.root.glob("lvx-run-*/pid-rank1.txt")
    os.kill(int(pid.read_text()), signal.SIGKILL)
    status, error = status_of(lambda: c.chat.completions.create(model="m", messages=video))
    assert status == 503 and "rank 1" in error["message"] and error["code"] == "restarting", error
    while httpx.get(server.url + "health").status_code == 503:
        time.sleep(0.5)
    assert httpx.get(server.url + "health").json()["status"] == "ok"
    reply = c.chat.completions.create(model="m", messages=video)
    assert reply.choices[0].message.content == expected[0]
    assert "lvx serve: the workers restarted after: rank 1" in server.log.read_text()


@pytest.mark.slow
def test_no_ui_serves_the_api_alone(tiny_checkpoints, tmp_path):
    log = tmp_path / "serve.log"
    proc, url = start_server(["--no-ui", "--gpus", "0", "--model", tiny_checkpoints["g2"]], log)
    try:
        assert httpx.get(url + "health").json()["status"] == "ok"
        assert httpx.get(url).status_code == 404  # no page
        c = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0)
        hello = [{"role": "user", "content": "hello, who are you?"}]
        reply = c.chat.completions.create(
            model="m", messages=hello, max_tokens=PARAMS.max_new_tokens
        )
        assert reply.choices[0].message.content == _greedy(tiny_checkpoints["g2"], hello)
    finally:
        stop_server(proc, log)


def test_a_reachable_host_needs_a_key(tmp_path, monkeypatch):
    """Checked with the options, before any model is loaded: one line, exit code 2."""
    from typer.testing import CliRunner

    from lvx_app.cli.main import app

    runner = CliRunner()
    for args, env in ((["--host", "0.0.0.0"], {}), (["--share"], {})):
        result = runner.invoke(app, ["serve", "--model", str(tmp_path), *args], env=env)
        said = (result.stdout + result.stderr).strip().splitlines()
        assert result.exit_code == 2 and len(said) == 1 and "--api-key KEY" in said[0], said

    seen = []
    monkeypatch.setattr("lvx_ui.server.run_serve", lambda config: seen.append(config.serve) or 0)
    for args, env in ((["--insecure"], {}), ([], {"LVX_API_KEY": "from-env"})):
        args = ["serve", "--model", str(tmp_path), "--host", "0.0.0.0", *args]
        assert runner.invoke(app, args, env=env).exit_code == 0
    assert seen[0].insecure and seen[0].api_key is None
    assert seen[1].api_key == "from-env" and not seen[1].insecure


def test_stop_strings_hold_back_what_may_start_one():
    from lvx_ui.openai_routes import StopStrings

    stops = StopStrings(["END", "xy"])
    assert [stops.push(p) for p in ("ab", "cE", "N", "x")] == ["ab", "c", "", "EN"]
    assert stops.push("z") == "xz" and not stops.hit
    assert stops.push("wE") == "w" and stops.push("ND tail") == "" and stops.hit
    plain = StopStrings([])
    assert plain.push("a") == "a" and plain.flush() == ""


def test_messages_keep_their_order_around_the_video():
    from lvx_app.engine.records import VideoOpening
    from lvx_ui.openai_request import ApiError, read_request

    url = {"type": "video_url", "video_url": {"url": "file:///v.mp4"}}
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    url,
                    {"type": "text", "text": "What"},
                    {"type": "text", "text": "happens?"},
                ],
            },
        ],
        "max_completion_tokens": 5,
        "max_tokens": 9,
        "fps": 2,
        "max_frames": 0,
    }
    req = read_request(body)
    assert req.turns[1] == {"role": "user", "content": "Look:\n<|video|>What\nhappens?"}
    assert req.video.opening == VideoOpening(system="Be brief.", before="Look:\n")
    assert req.video.options == {"fps": 2, "max_frames": 0}  # checked when the load is built
    assert req.generation == {"max_new_tokens": 5} and not req.stream
    late = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [url]}]}
    with pytest.raises(ApiError, match="first user message"):
        read_request(late)
    with pytest.raises(ApiError, match="unsupported content part 'input_audio'"):
        read_request({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    with pytest.raises(ApiError, match="an image_url part needs"):
        read_request({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    qwen = {"type": "video", "video": "file:///v.mp4"}  # a Qwen-style part naming the video
    req = read_request(
        {"messages": [{"role": "user", "content": [qwen, {"type": "text", "text": "?"}]}]}
    )
    assert req.video.url == "file:///v.mp4" and req.turns[0]["content"] == "<|video|>?"


def test_a_video_url_that_is_no_path_is_a_400_line(tmp_path):
    """A NUL byte in a file:// URL is refused in one line, as the page refuses it, not a 500."""
    from lvx_ui.openai_request import ApiError, VideoFiles

    files = VideoFiles([str(tmp_path)], 10.0, tmp_path / "uploads")
    with pytest.raises(ApiError, match="is not a path") as refused:
        files.video(f"file://{tmp_path}/a%00b.mp4")
    assert refused.value.status == 400 and refused.value.param == "video_url"


def test_a_video_sent_as_data_is_saved_as_sent_across_decoding_pieces(tmp_path, monkeypatch):
    """A data: URL's video is decoded a piece at a time; the file holds the bytes sent, whatever
    the pieces' size, and padding before the end or a character past ASCII is a 400 line."""
    from pathlib import Path

    import lvx_ui.openai_request as openai_request
    from lvx_ui.openai_request import ApiError, VideoFiles

    monkeypatch.setattr(openai_request, "BASE64_PIECE", 8)
    files = VideoFiles([], 10.0, tmp_path / "uploads")
    for size in (0, 1, 5, 6, 7, 12, 31):
        raw = os.urandom(size)
        saved = files.video("data:video/mp4;base64," + base64.b64encode(raw).decode())
        assert Path(saved).read_bytes() == raw, size
    for bad_url in ("data:video/mp4;base64,AA==AAAA", "data:video/mp4;base64,AAAA\u00e9AAA"):
        with pytest.raises(ApiError, match="not valid base64") as refused:
            files.video(bad_url.encode().decode("unicode_escape"))
        assert refused.value.status == 400


def test_allow_paths_judges_a_path_as_given_and_as_resolved(tmp_path):
    """A link inside an allowed folder (a Hugging Face cache's snapshot files are links into its
    blobs) is allowed as given; an allowed folder reached through a link is allowed once resolved;
    `..` counts only resolved (never a link's `..` read as text); a refusal names both paths."""
    from lvx_ui.openai_request import ApiError, VideoFiles

    allowed, outside = tmp_path / "allowed", tmp_path / "blobs"
    (outside / "sub").mkdir(parents=True)
    allowed.mkdir()
    (outside / "abc123").write_bytes(b"a video")
    (outside / "secret").write_bytes(b"not for clients")
    (allowed / "clip.mp4").symlink_to(outside / "abc123")
    (allowed / "videos").symlink_to(outside / "sub", target_is_directory=True)
    (tmp_path / "alias").symlink_to(allowed, target_is_directory=True)
    (tmp_path / "elsewhere.mp4").symlink_to(outside / "abc123")
    files = VideoFiles([str(allowed)], 10.0, tmp_path / "uploads")
    assert files.video(f"file://{allowed}/clip.mp4") == str(allowed / "clip.mp4")
    assert files.video(f"file://{tmp_path}/alias/clip.mp4") == str(allowed / "clip.mp4")
    for given, resolved in (
        (f"{allowed}/videos/../secret", outside / "secret"),
        (f"{allowed}/../blobs/secret", outside / "secret"),
        (f"{tmp_path}/elsewhere.mp4", outside / "abc123"),
    ):
        with pytest.raises(ApiError) as refused:
            files.video(f"file://{given}")
        message = refused.value.message
        assert refused.value.status == 400 and "outside the allowed folders" in message
        assert given in message and f"resolved: {resolved}" in message, message


def test_a_long_path_costs_work_in_proportion_to_its_length(tmp_path, monkeypatch):
    """`"/a" * N` under --allow-paths checks: the file system is asked (lstat) a number of times
    that grows with N, not N squared; the path is still judged."""
    import os

    from lvx_ui.openai_request import allowed_path

    calls, lstat = [0], os.lstat

    def counted(*args, **kwargs):
        calls[0] += 1
        return lstat(*args, **kwargs)

    monkeypatch.setattr(os, "lstat", counted)

    def work(n: int) -> int:
        calls[0] = 0
        with pytest.raises(ValueError, match="outside the allowed folders"):
            allowed_path("/a" * n, [tmp_path])
        inside = allowed_path(f"{tmp_path}" + "/a" * n, [tmp_path])
        assert str(inside) == f"{tmp_path}" + "/a" * n
        return calls[0]

    small, large = work(500), work(2000)
    assert large < 6 * small, (small, large)  # 4 times the length; quadratic would be 16 times


def test_a_request_that_waits_past_queue_timeout_is_429_with_retry_after(tmp_path):
    """--queue-timeout bounds an API request's wait for the engine: past it, a 429 in OpenAI's
    shape with Retry-After, and the request leaves the queue."""
    from dataclasses import replace

    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from test_service import StandIn
    from timing import scaled

    from lvx_app.config import Config
    from lvx_app.runtime.service import EngineService
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    config = Config.from_options(model=str(tmp_path))
    config = replace(config, serve=replace(config.serve, queue_timeout=0.2))
    service = EngineService(StandIn(), queue_size=config.serve.queue_size)
    app = FastAPI()
    files = VideoFiles([], 1.0, tmp_path / "uploads")
    reported: list[str] = []
    OpenAIApi(service, config, files, report=reported.append).mount(app)
    holder = service.lease("the page")
    # without the bound the request would wait for this, then answer 200
    threading.Timer(scaled(30), holder.close).start()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    reply = TestClient(app).post("/v1/chat/completions", json=body)
    holder.close()
    assert reply.status_code == 429 and reply.headers["retry-after"].isdigit(), reply.text
    assert reply.json()["error"]["type"] == "rate_limit_error"
    assert "busy for 0.2 s" in reply.json()["error"]["message"]
    assert not service._waiting
    (line,) = reported  # the server's log has the refusal, as an access log would
    assert line.startswith('api: testclient:50000 "POST /v1/chat/completions" 429 queue_full: ')


def test_every_refused_request_has_a_line_in_the_servers_log(tmp_path):
    """Status, reason and client of each refusal, whatever refused it (the key, the request, the
    path): a harness that scored only errors shows in the server's log."""
    from dataclasses import replace

    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from test_service import StandIn

    from lvx_app.config import Config
    from lvx_app.runtime.service import EngineService
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    config = Config.from_options(model=str(tmp_path))
    config = replace(config, serve=replace(config.serve, api_key="k"))
    service = EngineService(StandIn(), queue_size=config.serve.queue_size)
    app, reported = FastAPI(), []
    files = VideoFiles([str(tmp_path / "allowed")], 1.0, tmp_path / "uploads")
    OpenAIApi(service, config, files, report=reported.append).mount(app)
    client, key = TestClient(app), {"Authorization": "Bearer k"}
    video = {"type": "video_url", "video_url": {"url": f"file://{tmp_path}/elsewhere.mp4"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [video]}]}
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/chat/completions", json=body).status_code == 401
    assert client.post("/v1/chat/completions", json=body, headers=key).status_code == 400
    assert client.post("/v1/chat/completions", json={}, headers=key).status_code == 400
    where = 'api: testclient:50000 "'
    assert [line.split(":", 3)[:2] for line in reported] == [["api", " testclient"]] * 4, reported
    assert reported[0].startswith(where + 'GET /v1/models" 401 invalid_api_key: '), reported
    assert reported[1].startswith(where + 'POST /v1/chat/completions" 401 invalid_api_key: ')
    assert "400 invalid_request: " in reported[2] and "outside the allowed folders" in reported[2]
    assert "400 invalid_request: " in reported[3], reported


@pytest.fixture
def api_here(tiny_checkpoints, short_video, tmp_path):
    """The API on an engine in this process (the page's engine service, no server): a clip with a
    subtitle file beside it and another one, under --allow-paths."""
    from engine_configs import engine_config
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from lvx_app.runtime.open import open_engine
    from lvx_app.runtime.service import EngineService
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    folder = tmp_path / "videos"
    folder.mkdir()
    clip = shutil.copy(short_video, folder / "clip.mp4")
    (folder / "clip.srt").write_text("1\n00:00:00,000 --> 00:00:09,500\nbeside the clip\n")
    (folder / "other.srt").write_text("1\n00:00:00,000 --> 00:00:09,500\nfrom another file\n")
    config = engine_config(tiny_checkpoints["g2"], tmp_path / "cache", subtitles="auto")
    engine = open_engine(config)
    service = EngineService(engine)
    files = VideoFiles([str(folder)], 10.0, tmp_path / "uploads")
    app = FastAPI()
    OpenAIApi(service, config, files, report=lambda line: None).mount(app)
    try:
        yield TestClient(app), engine, f"file://{clip}", folder
    finally:
        service.close()


def test_the_subtitles_field_loads_as_the_option_says(api_here):
    """The documented `subtitles` field (auto, none, a file under --allow-paths) loads the video
    with those subtitles; a bad value is a 400 naming it, and the engine goes on."""
    client, engine, url, folder = api_here

    def ask(**fields):
        body = {"model": "m", "messages": [video_message(url)], "max_tokens": 2, **fields}
        return client.post("/v1/chat/completions", json=body)

    tokens = {}
    for choice, line in (
        ("none", None),
        ("auto", "beside the clip"),
        (str(folder / "other.srt"), "from another file"),
    ):
        reply = ask(subtitles=choice)
        assert reply.status_code == 200, reply.text
        tokens[choice] = reply.json()["usage"]["prompt_tokens"]
        block = engine.session.video.loaded.subtitle_block
        assert (line in block) if line else block == "", (choice, block)
    assert tokens["none"] < tokens["auto"] and len(set(tokens.values())) == 3
    reply = ask()  # the server's default (here auto): what /v1/models says a request gets
    assert reply.json()["usage"]["prompt_tokens"] == tokens["auto"]
    assert "beside the clip" in engine.session.video.loaded.subtitle_block
    (model,) = client.get("/v1/models").json()["data"]
    assert model["lvx_video_defaults"]["subtitles"] == "auto"
    # the held video's kv mode and how auto chose it (on a CPU: the host's memory)
    assert model["lvx_kv_mode"]["last load"]["mode"] == "cache", model["lvx_kv_mode"]
    for fields, param, says in (
        ({"subtitles": "/etc/hostname"}, "subtitles", "outside the allowed folders"),
        ({"subtitles": 5}, "subtitles", "subtitles takes auto, speech, none or FILE, not 5"),
        ({"fps": "2"}, "fps", "fps takes a number, not '2'"),
        ({"max_frames": "3"}, "max_frames", "max_frames takes a whole number, not '3'"),
        ({"max_frames": -1}, "max_frames", "max_frames must be 1 or more"),
    ):
        reply = ask(**fields)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == param, (fields, error)
        assert says in error["message"] and "--" not in error["message"], error
    reply = ask(max_frames=0, fps=2)  # 0: no cap
    assert reply.status_code == 200 and engine.session.video.loaded.summary.frames == 20


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1), ("temperature", True), ("top_p", 0), ("top_p", "0.5"), ("seed", 1.5)],
)
def test_sampling_fields_are_checked_by_the_configs_own_rule(field, value):
    """The API words the config's one check by its field names: no second rule that could
    disagree (JSON's true is no temperature for either)."""
    from lvx_app.config import ConfigError, GenerationConfig, updated
    from lvx_ui.openai_request import ApiError, read_generation

    with pytest.raises(ConfigError) as by_config:
        updated(GenerationConfig(), **{field: value})
    with pytest.raises(ApiError) as by_api:
        read_generation({field: value})
    flag = "--" + field.replace("_", "-")
    assert str(by_api.value) == str(by_config.value).replace(flag, field)
    assert by_api.value.param == field
    assert read_generation({field: getattr(GenerationConfig(), field)}) == {
        field: getattr(GenerationConfig(), field)
    }
