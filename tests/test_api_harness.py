"""The OpenAI-compatible API as evaluation harnesses drive it (lmms-eval's `openai` model): a video
sent as its frames (base64 PNG `image_url` parts, text before or after them), vLLM's frame options
(`media_io_kwargs`), vLLM's `data:video/jpeg;base64,<f1>,<f2>,...` and 32 requests at once with the
default queue; the official `openai` client against a served tiny checkpoint (one process).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from lvx_app.video.synthetic import frame_image, read_index  # noqa: E402
from scripts.gloo_ranks import free_port  # noqa: E402

N_FRAMES = 8


pytestmark = pytest.mark.slow  # every test here talks to one server


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port, in a thread, for the block; yields its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    started = threading.Event()
    while not server.started and thread.is_alive():
        started.wait(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@pytest.fixture(scope="module")
def served(tiny_checkpoints, short_video, tmp_path_factory):
    """The API on a tiny engine under uvicorn, the default queue settings, a clip under
    --allow-paths; yields (url, engine, the clip's file:// URL, the upload folder)."""
    from engine_configs import engine_config
    from fastapi import FastAPI

    from lvx_app.runtime.open import open_engine
    from lvx_app.runtime.service import EngineService
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    root = tmp_path_factory.mktemp("harness")
    folder = root / "videos"
    folder.mkdir()
    clip = shutil.copy(short_video, folder / "clip.mp4")
    config = engine_config(tiny_checkpoints["g2"], root / "cache", max_new_tokens=2)
    config = replace(config, serve=replace(config.serve, max_upload_mb=10.0))  # default queue
    engine = open_engine(config)
    service = EngineService(engine, queue_size=config.serve.queue_size)
    files = VideoFiles([str(folder)], config.serve.max_upload_mb, root / "uploads")
    app = FastAPI()
    reported = Reports()
    OpenAIApi(service, config, files, report=reported.add).mount(app)
    try:
        with serving(app) as url:
            Served.reported = reported
            yield Served(url, engine, f"file://{clip}", root / "uploads")
    finally:
        service.close()


class Reports:
    """The API's one line per answer, and an event per line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.added = threading.Condition()

    def add(self, line: str) -> None:
        with self.added:
            self.lines.append(line)
            self.added.notify_all()

    def wait_beyond(self, count: int) -> str:
        with self.added:
            self.added.wait_for(lambda: len(self.lines) > count)
            return self.lines[count]


class Served(tuple):
    """(url, engine, the clip's file:// URL, the upload folder); `.reported`: the API's lines."""

    reported: Reports

    def __new__(cls, *items):
        return super().__new__(cls, items)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def png(index: int) -> str:
    """Frame `index` of a synthetic video as lmms-eval sends it: a base64 PNG data URL."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame_image(index, 96, 64)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def frames_message(frames: list[str], before: str = "", after: str = "") -> dict:
    """lmms-eval's message: the text, then one image_url part per frame (or the other way)."""
    parts = [{"type": "text", "text": before}] if before else []
    parts += [{"type": "image_url", "image_url": {"url": f}} for f in frames]
    parts += [{"type": "text", "text": after}] if after else []
    return {"role": "user", "content": parts}


def _indices(path: str) -> list[int]:
    import decord

    reader = decord.VideoReader(path)
    return [read_index(f) for f in reader.get_batch(list(range(len(reader)))).asnumpy()]


def test_a_video_sent_as_eight_png_frames_is_one_video_of_eight_frames(served):
    url, engine, _, uploads = served
    frames = [png(i) for i in range(N_FRAMES)]
    question = "What is shown? Answer with the letter."
    for message, before in (
        (frames_message(frames, before=question), question + "\n"),
        (frames_message(frames, after=question), ""),
    ):
        reply = client(url).chat.completions.create(model="m", messages=[message], max_tokens=2)
        assert reply.choices[0].message.content is not None
        assert reply.usage.model_extra["frames"] == N_FRAMES
        assert engine.session.video.loaded.summary.frames == N_FRAMES
        assert _indices(engine.held.path) == list(range(N_FRAMES))  # in the order given
        assert engine.held.opening.before == before  # the text stays where it stood


def test_num_frames_samples_the_frames_vllm_samples_and_unknown_keys_are_refused(served):
    """vLLM's frame options on a 100-frame clip: num_frames is exactly that many frames spread over
    the whole video, the very frames vLLM's loader picks (fps given beside it is unused, as there),
    mm_processor_kwargs alike; any other key is one 400 line."""
    url, engine, clip, _ = served
    c = client(url)
    message = {"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}}]}
    message["content"].append({"type": "text", "text": "What happens?"})
    for extra, frames in (
        ({"media_io_kwargs": {"video": {"num_frames": 4}}}, 4),
        ({"media_io_kwargs": {"video": {"num_frames": 32, "fps": 2}}}, 32),
        ({"mm_processor_kwargs": {"num_frames": 3}}, 3),
    ):
        reply = c.chat.completions.create(
            model="m", messages=[message], max_tokens=2, extra_body=extra
        )
        summary = engine.session.video.loaded.summary
        assert reply.usage.model_extra["frames"] == frames == summary.frames
        vllm = np.linspace(0, 100 - 1, frames, dtype=int).tolist()  # vLLM's OpenCV loader
        assert [round(t * 10) for t in summary.timestamps] == vllm, extra  # 10 fps: frame i/10
    for extra, says in (
        ({"media_io_kwargs": {"video": {"num_frames": 4, "max_pixels": 9}}}, "max_pixels"),
        ({"mm_processor_kwargs": {"min_pixels": 3}}, "min_pixels"),
        ({"media_io_kwargs": {"image": {}}}, "media_io_kwargs takes"),
    ):
        with pytest.raises(openai.BadRequestError, match=says):
            c.chat.completions.create(model="m", messages=[message], extra_body=extra)


def test_vllm_frames_as_a_jpeg_video_data_url(served):
    from PIL import Image

    url, engine, _, _ = served

    def jpeg(i: int) -> str:
        out = io.BytesIO()
        Image.fromarray(frame_image(i, 96, 64)).save(out, format="JPEG", quality=95)
        return base64.b64encode(out.getvalue()).decode()

    data = "data:video/jpeg;base64," + ",".join(jpeg(i) for i in range(5))
    message = {"role": "user", "content": [{"type": "video_url", "video_url": {"url": data}}]}
    message["content"].append({"type": "text", "text": "What happens?"})
    reply = client(url).chat.completions.create(model="m", messages=[message], max_tokens=2)
    assert reply.usage.model_extra["frames"] == 5
    assert _indices(engine.held.path) == list(range(5))


def test_frames_as_files_and_as_a_qwen_video_part_at_the_rate_asked(served, tmp_path):
    """Frames given as file:// URLs under --allow-paths, or as a Qwen-style `{"type": "video",
    "video": [urls]}` part, are one video in the order given: one frame a second unless the body
    names an fps (6 frames at fps 2 span 3 seconds); a frame outside --allow-paths is a 400."""
    url, engine, clip, _ = served
    folder = clip.removeprefix("file://").rsplit("/", 1)[0]
    files = []
    for i in (5, 3, 1, 0, 2, 4):
        with open(f"{folder}/frame{i}.png", "wb") as out:
            out.write(base64.b64decode(png(i).partition(",")[2]))
        files.append(f"file://{folder}/frame{i}.png")
    c = client(url)
    qwen = {"role": "user", "content": [{"type": "text", "text": "What happens?"}]}
    qwen["content"].append({"type": "video", "video": [png(i) for i in range(6)]})
    for message, fps, order in (
        (frames_message(files, after="What happens?"), None, [5, 3, 1, 0, 2, 4]),
        (qwen, 2.0, list(range(6))),
    ):
        extra = {"fps": fps} if fps else {}
        reply = c.chat.completions.create(
            model="m", messages=[message], max_tokens=2, extra_body=extra
        )
        assert reply.usage.model_extra["frames"] == 6
        summary = engine.session.video.loaded.summary
        assert summary.timestamps == pytest.approx([k / (fps or 1.0) for k in range(6)])
        assert _indices(engine.held.path) == order
    (tmp_path / "frame.png").write_bytes(base64.b64decode(png(0).partition(",")[2]))
    with pytest.raises(openai.BadRequestError, match="outside the allowed folders"):
        outside = [files[0], f"file://{tmp_path}/frame.png"]
        c.chat.completions.create(model="m", messages=[frames_message(outside, "?")])


def test_32_requests_at_once_all_answer_with_the_default_queue(served):
    """lmms-eval's default: 32 concurrent requests (each a video as frames); none is refused."""
    url, _, _, _ = served
    c = client(url)
    start, results = threading.Barrier(32), []

    def one(i: int) -> None:
        message = frames_message([png(i), png(i + 1)], after=f"Question {i}?")
        start.wait()
        try:
            reply = c.chat.completions.create(model="m", messages=[message], max_tokens=2)
            results.append(reply.choices[0].finish_reason)
        except openai.APIStatusError as exc:
            results.append(exc.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 32 and all(r in ("stop", "length") for r in results), results


def test_a_request_whose_client_left_while_it_waited_loads_nothing(tmp_path):
    """A harness's request that timed out in the queue (its client gone, a retry on its way) gives
    its turn back unanswered: no video load, no prefill for nobody (on the service's stand-in)."""
    from fastapi import FastAPI
    from test_service import StandIn
    from timing import scaled

    from lvx_app.config import Config
    from lvx_app.runtime.service import EngineService
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    class Chatting(StandIn):
        def chat(self, turns, **generation):
            return self.ask(turns[-1]["content"], **generation)

    (tmp_path / "clip.mp4").write_bytes(b"a video the stand-in never decodes")
    engine, reported = Chatting(), Reports()
    config = Config.from_options(model=str(tmp_path))
    service = EngineService(engine, queue_size=config.serve.queue_size)
    app = FastAPI()
    files = VideoFiles([str(tmp_path)], 1.0, tmp_path / "uploads")
    OpenAIApi(service, config, files, report=reported.add).mount(app)
    holder = service.lease("the page")
    video = {"type": "video_url", "video_url": {"url": f"file://{tmp_path}/clip.mp4"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [video]}], "max_tokens": 2}
    pause = threading.Event()  # never set: a wait that wakes on time
    with serving(app) as url:

        def leaves() -> None:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1.0)

        try:
            client = threading.Thread(target=leaves)
            client.start()
            while not service._waiting:
                pause.wait(0.01)
            client.join()
            pause.wait(scaled(0.5))  # the server sees the connection close
            holder.close()
            line = reported.wait_beyond(0)
            with service.lease("next", timeout=scaled(60)):  # after the request that waited
                assert engine.loads == [], line
            assert line == "api: not answered, the client went away while it waited", line
        finally:
            holder.close()


def test_one_image_is_refused_and_a_bad_frame_is_a_400_line(served):
    url, _, _, _ = served
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="one image is a still picture"):
        c.chat.completions.create(model="m", messages=[frames_message([png(0)], after="?")])
    junk = "data:image/png;base64," + base64.b64encode(b"no image").decode()
    with pytest.raises(openai.BadRequestError, match="frame 2 is not a PNG or JPEG image"):
        c.chat.completions.create(model="m", messages=[frames_message([png(0), junk], "?")])


def test_another_clients_conversation_is_not_reused(served):
    """A secret in one client's system prompt: another client's right guess is counted as cached
    no more than a wrong one (only the chat template's first tokens are shared), while the same
    client's request sent again reuses its whole prefix."""
    url, _, _, _ = served
    c = client(url)

    def cached(user: str, system: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
        reply = c.chat.completions.create(model="m", messages=messages, max_tokens=2, user=user)
        return reply.usage.prompt_tokens_details.cached_tokens

    secret = "The password is swordfish, and the door code is 4711."
    cached("victim", secret)
    right = cached("attacker", secret)
    cached("victim", secret)
    wrong = cached("attacker", "Something else entirely, of about the same length.")
    assert right == wrong
    assert cached("attacker", "Something else entirely, of about the same length.") > right + 10


def test_another_clients_words_before_the_video_are_not_reused(served, monkeypatch):
    """A secret system prompt before the video: another client's right guess reuses no more tokens
    than a wrong one (counted as the tokens the ranks did not feed), with the video or without it,
    while the same client sent again reuses its whole prompt."""
    from lvx_app.engine.conversation import Conversation

    url, _, clip, _ = served
    fed, prefill = [], Conversation.prefill

    def counted(self, ids, **kwargs):
        fed.append(int(ids.numel()))
        return prefill(self, ids, **kwargs)

    monkeypatch.setattr(Conversation, "prefill", counted)
    c = client(url)

    def reused(user: str, system: str, video: bool = True) -> int:
        fed.clear()
        parts = [{"type": "text", "text": "Watch this clip."}]
        parts += [{"type": "video_url", "video_url": {"url": clip}}] if video else []
        parts += [{"type": "text", "text": "What is in it?"}]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": parts}]
        reply = c.chat.completions.create(model="m", messages=messages, max_tokens=2, user=user)
        return reply.usage.prompt_tokens - sum(fed)

    secret = "The password is swordfish, and the door code is 4711."
    other = "Something else entirely, of about the same length."
    reused("victim", secret)
    right = reused("attacker", secret)
    reused("victim", secret)
    wrong = reused("attacker", other)
    assert right == wrong
    assert reused("attacker", other) > right + 10  # the same client: its whole prompt
    reused("victim", secret)
    right = reused("attacker", secret, video=False)
    reused("victim", secret)
    wrong = reused("attacker", other, video=False)
    assert right == wrong


def test_a_video_swapped_for_a_fifo_while_its_request_waits_is_a_400_line(served, monkeypatch):
    """The file passes the API's checks, then becomes a FIFO while the request waits for the
    engine (subtitles auto probes it first): a 400 naming the FIFO, nothing waits for a writer,
    and the next request is answered."""
    from test_fifo_files import unblocked

    from lvx_app.runtime.service import EngineService

    url, _, clip, _ = served
    folder = clip.removeprefix("file://").rsplit("/", 1)[0]
    video = f"{folder}/swapped.mp4"
    shutil.copy(clip.removeprefix("file://"), video)
    lease = EngineService.lease

    def swap_then_lease(self, *args, **kwargs):
        os.remove(video)
        os.mkfifo(video)
        return lease(self, *args, **kwargs)

    monkeypatch.setattr(EngineService, "lease", swap_then_lease)
    parts = [{"type": "video_url", "video_url": {"url": f"file://{video}"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    body["subtitles"] = "auto"
    post = f"{url}/v1/chat/completions"
    try:
        reply, freed = unblocked(video, lambda: httpx.post(post, json=body, timeout=None))
    finally:
        monkeypatch.undo()
        os.remove(video)
    assert not freed, "the request waited on the FIFO"
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "is a FIFO (named pipe), not a file" in message and "\n" not in message, message
    answer = client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.choices[0].message.content is not None


def test_surrogates_deep_nesting_and_a_large_chunked_body_are_400_and_413(served):
    url, _, _, _ = served
    post = f"{url}/v1/chat/completions"
    body = b'{"model":"m","messages":[{"role":"user","content":"caf\\ud800"}]}'
    reply = httpx.post(post, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid Unicode" in reply.json()["error"]["message"]
    deep = b"[" * 100_000 + b"]" * 100_000
    reply = httpx.post(post, content=deep)
    assert reply.status_code == 400 and "nested too deeply" in reply.json()["error"]["message"]

    def chunks():  # 20 MB without a Content-Length: over the 10 MB limit
        for _ in range(20):
            yield b" " * 2**20

    reply = httpx.post(post, content=chunks())
    assert reply.status_code == 413, reply.text
    reply = httpx.post(post, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200  # the server goes on


@pytest.mark.parametrize(
    "kind", ["mp4/../../x", "../mp4", "mp\x004", "a" * 300, "", "MP4 "], ids=repr
)
def test_a_data_url_type_that_is_no_short_name_is_a_400_line(tmp_path, kind):
    from lvx_ui.openai_request import ApiError, VideoFiles

    files = VideoFiles([], 10.0, tmp_path / "uploads")
    url = f"data:video/{kind};base64," + base64.b64encode(b"\0" * 64).decode()
    with pytest.raises(ApiError, match="data:video/<type>;base64") as refused:
        files.video(url)
    assert refused.value.status == 400
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob(".*.part"))


def test_uploads_held_by_waiting_requests_are_kept(tmp_path):
    """Only the newest uploads nobody uses are kept; one a queued request holds stays."""
    from lvx_ui.openai_request import KEEP_UPLOADS, VideoFiles

    files = VideoFiles([], 10.0, tmp_path / "uploads")

    def upload(i: int) -> str:
        data = base64.b64encode(np.full(32, i, dtype=np.uint8).tobytes()).decode()
        return files.video(f"data:video/mp4;base64,{data}")

    waiting = upload(0)
    done = [upload(i) for i in range(1, KEEP_UPLOADS + 3)]
    for path in done:
        files.release(path)
    files.video(f"data:video/mp4;base64,{base64.b64encode(b'last').decode()}")
    assert (tmp_path / "uploads" / waiting.rsplit("/", 1)[1]).exists()
    files.release(waiting)
    upload(99)
    assert not (tmp_path / "uploads" / waiting.rsplit("/", 1)[1]).exists()


def test_stop_strings_are_bounded():
    from lvx_ui.openai_request import ApiError, read_stop

    assert read_stop(["a"] * 16) == ["a"] * 16
    for stops in (["a"] * 17, ["x" * 257], "x" * 4_000_000):
        with pytest.raises(ApiError, match="stop takes at most 16 strings"):
            read_stop(stops)


def test_a_non_ascii_api_key_is_refused_at_start():
    from lvx_app.config import ConfigError, ServeConfig

    with pytest.raises(ConfigError, match="--api-key must be ASCII"):
        ServeConfig(api_key="clé")
    assert ServeConfig(api_key="k-1").api_key == "k-1"


@pytest.mark.parametrize("key", ["k\x07ey", "k\tey", "key\n", "k ey", "k\x7fey"], ids=repr)
def test_an_api_key_with_a_control_character_or_space_is_refused(key):
    from lvx_app.config import ConfigError, ServeConfig

    with pytest.raises(ConfigError, match="--api-key must be ASCII letters, digits and punct"):
        ServeConfig(api_key=key)


def test_an_empty_api_key_never_starts_an_open_server(monkeypatch, tmp_path):
    """`--api-key ""` and an empty LVX_API_KEY (an unset variable expanded) are one line each,
    exit 2, and no server starts."""
    from typer.testing import CliRunner

    from lvx_app.cli.main import app

    started = []
    monkeypatch.setattr("lvx_ui.server.run_serve", lambda config: started.append(config) or 0)
    args = ["serve", "--model", str(tmp_path)]
    for extra, env in ((["--api-key", ""], {}), ([], {"LVX_API_KEY": ""})):
        result = CliRunner().invoke(app, [*args, *extra], env=env)
        said = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in said, said
        assert "empty (an unset variable?)" in said, said
    assert not started
    result = CliRunner().invoke(app, args, env={"LVX_API_KEY": "k-1"})
    assert result.exit_code == 0 and started[0].serve.api_key == "k-1", result.output


def test_serve_subtitles_sets_the_default_and_models_says_it(served, tmp_path, monkeypatch):
    """`lvx serve --subtitles none` is the default of every request (and of the page); /v1/models
    says the defaults a request gets."""
    from typer.testing import CliRunner

    from lvx_app.cli.main import app

    seen = []
    monkeypatch.setattr("lvx_ui.server.run_serve", lambda config: seen.append(config.video) or 0)
    args = ["serve", "--model", str(tmp_path), "--subtitles", "none", "--queue-timeout", "60"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stdout
    assert seen[0].subtitles == "none"
    url, _, _, _ = served
    (model,) = httpx.get(url + "/v1/models").json()["data"]
    assert model["lvx_video_defaults"] == {"fps": 1.0, "max_frames": 0, "subtitles": "none"}
    kv = model["lvx_kv_mode"]  # the held video's mode and why (none held: {}), whatever ran before
    assert kv["asked"] == "auto" and kv["last load"].get("mode", "cache") == "cache", kv
    assert not kv["last load"] or "host memory" in kv["last load"]["why"], kv


def test_a_client_that_leaves_a_whole_answer_stops_it(served):
    """Without streaming too, a client that goes away frees the engine: its answer stops (it would
    run 4,000 tokens), and the next request is answered."""
    url, _, _, _ = served
    before = len(served.reported.lines)
    body = {"model": "m", "messages": [{"role": "user", "content": "a long story"}]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 4000}, timeout=1.0)
    line = served.reported.wait_beyond(before)
    assert "stopped: the client went away" in line and int(line.split()[1]) < 4000, line
    reply = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=600)
    assert reply.status_code == 200


def test_max_tokens_is_bounded_by_the_models_context(served, tiny_checkpoints):
    """`max_tokens` beyond the model's positions is one 400 line before the engine is taken."""
    from lvx_models.mplug_owl3.config import Owl3Config

    url, _, _, _ = served
    context = Owl3Config.from_json(f"{tiny_checkpoints['g2']}/config.json").max_position_embeddings
    with pytest.raises(openai.BadRequestError, match=f"max_tokens must be at most {context}"):
        client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1_000_000_000
        )


def test_a_video_prompt_this_request_prefilled_is_not_counted_as_cached(served):
    """cached_tokens counted the prompt the request's own load had just prefilled as reused; it
    counts only what was held before the request."""
    from lvx_app.video.synthetic import make_video

    url, engine, clip, _ = served
    fresh = make_video(
        Path(clip.removeprefix("file://")).with_name("fresh.mp4"), 30, fps=10, width=96, height=64
    )
    c = client(url)
    message = {
        "role": "user",
        "content": [{"type": "video_url", "video_url": {"url": f"file://{fresh}"}}],
    }
    message["content"].append({"type": "text", "text": "What happens?"})

    def cached() -> tuple[int, int]:
        reply = c.chat.completions.create(model="m", messages=[message], max_tokens=2, user="me")
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    first, prompt = cached()
    assert not engine.session.video.loaded.summary.prompt_from_cache
    assert first == 0, (first, prompt)
    again, _ = cached()  # the same client again: the video prompt was held before it
    assert again >= engine.session.video.loaded.summary.prompt_tokens > 0
