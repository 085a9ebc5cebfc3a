"""The playground at `/` in a real headless Chromium (Debian's `chromium`, driven by Playwright): against
tiny servers it clicks through each tab the model's /v1/models card offers and checks what appears (streamed
chat text, an <audio> with a source, an <img> that decoded, a <video>, plots of actions and latents); a
screenshot of each tab is left under the test's tmp_path."""

from __future__ import annotations

import io
import shutil

import httpx
import numpy as np
import pytest

from mstar.server.protocol import TensorChunk
from tests.e2e.server_thread import running_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (apt-get install chromium): the playground test drives a real browser",
                allow_module_level=True)
WAIT_MS = 60_000


def _png(seed: int, size: tuple[int, int] = (32, 32)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright  # the dev extra's; only a missing chromium skips

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                              args=["--autoplay-policy=no-user-gesture-required"])
        yield chromium
        chromium.close()


# Counts the Web Audio buffers started, to see speech played while it streams (before the <audio> has it).
COUNT_PLAYED = """window.playedPieces = 0;
const start = AudioBufferSourceNode.prototype.start;
AudioBufferSourceNode.prototype.start = function (...args) { window.playedPieces += 1; return start.apply(this, args); };"""


def _wav(seconds: float = 0.2, rate: int = 16000) -> bytes:
    import soundfile

    samples = np.sin(np.linspace(0, 2 * np.pi * 440 * seconds, int(rate * seconds))).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV")
    return buf.getvalue()


def _open(browser, base: str):
    page = browser.new_page(viewport={"width": 1000, "height": 800})
    page.add_init_script(COUNT_PLAYED)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(base + "/")
    page.wait_for_selector("#tabs button")
    return page, errors


def _tab(page, name: str) -> None:
    page.click(f"#tabs button[data-tab={name}]")
    assert page.is_visible(f"#tab-{name}")


def _done(page, form: str) -> None:
    """Wait until `form`'s request has finished (its button is enabled again), then check no error shows."""
    page.wait_for_function(f"!document.querySelector('#{form} button').disabled", timeout=WAIT_MS)
    assert page.text_content("#status") == "", page.text_content("#status")


def test_toy_tabs_chat_speech_image_video(browser, tmp_path) -> None:
    with running_server({"model": "toy"}, ui=True) as base:
        page, errors = _open(browser, base)
        tabs = page.eval_on_selector_all("#tabs button", "bs => bs.map(b => b.dataset.tab)")
        assert tabs == ["chat", "speech", "image", "video"]  # the toy's card: text, audio, image, video out

        _tab(page, "chat")
        page.fill("#chat-input", "hello there")
        page.set_input_files("#chat-file", {"name": "dot.png", "mimeType": "image/png", "buffer": _png(0)})
        page.click("#chat-form button")
        _done(page, "chat-form")
        assert page.text_content("#chat-log .msg.user") == "hello there [dot.png]"
        assert page.text_content("#chat-log .msg.assistant").strip()
        page.fill("#chat-input", "and this")
        page.set_input_files("#chat-file", {"name": "tone.wav", "mimeType": "audio/wav", "buffer": _wav()})
        page.click("#chat-form button")
        _done(page, "chat-form")
        replies = page.eval_on_selector_all("#chat-log .msg.assistant", "ms => ms.map(m => m.textContent)")
        assert len(replies) == 2 and replies[1].strip()
        page.screenshot(path=tmp_path / "chat.png")

        _tab(page, "speech")
        assert page.eval_on_selector_all("#speech-voice option", "os => os.map(o => o.textContent)") == ["default"]
        page.click("#speech-form button")
        _done(page, "speech-form")
        assert page.evaluate("window.playedPieces") >= 1
        assert page.get_attribute("#speech-audio", "src").startswith("blob:")
        page.wait_for_function("document.querySelector('#speech-audio').duration > 0", timeout=WAIT_MS)
        page.screenshot(path=tmp_path / "speech.png")

        _tab(page, "image")
        page.click("#image-form button")
        _done(page, "image-form")
        page.wait_for_function("document.querySelector('#image-out img')?.naturalWidth > 0", timeout=WAIT_MS)
        assert page.eval_on_selector("#image-progress", "p => !p.hidden && p.value") > 0  # the toy reports it
        page.screenshot(path=tmp_path / "image.png")

        _tab(page, "video")
        page.click("#video-form button")
        _done(page, "video-form")
        assert page.get_attribute("#video-out video", "src").startswith("blob:")
        page.wait_for_function("document.querySelector('#video-out video').videoWidth > 0", timeout=WAIT_MS)
        assert page.eval_on_selector("#video-progress", "p => p.value") == 100
        page.screenshot(path=tmp_path / "video.png")
        assert errors == []


def test_orpheus_voice_picker(browser, tmp_path) -> None:
    with running_server({"model": "orpheus"}, tiny=True, ui=True) as base:
        page, errors = _open(browser, base)
        assert page.eval_on_selector_all("#tabs button", "bs => bs.map(b => b.dataset.tab)") == ["speech"]
        voices = httpx.get(f"{base}/v1/models").json()["data"][0]["voices"]
        assert page.eval_on_selector_all("#speech-voice option", "os => os.map(o => o.value)") == voices
        page.select_option("#speech-voice", voices[1])
        page.click("#speech-form button")
        _done(page, "speech-form")
        assert page.evaluate("window.playedPieces") > 1  # Orpheus streams its speech in pieces
        assert page.get_attribute("#speech-audio", "src").startswith("blob:")
        page.screenshot(path=tmp_path / "speech-orpheus.png")
        assert errors == []


def test_pi05_actions_plot(browser, tmp_path) -> None:
    with running_server({"model": "pi05"}, tiny=True, ui=True) as base:
        page, errors = _open(browser, base)
        _tab(page, "actions")
        page.set_input_files("#actions-file", {"name": "cam.png", "mimeType": "image/png", "buffer": _png(1)})
        page.fill("#actions-state", ",".join(["0.1"] * 8))
        page.click("#actions-form button")
        _done(page, "actions-form")
        assert page.eval_on_selector_all("#actions-out svg.plot polyline", "ls => ls.length") == 7  # [10, 7] chunk
        page.screenshot(path=tmp_path / "actions.png")
        assert errors == []


def test_vjepa2_latents_plot(browser, tmp_path) -> None:
    with running_server({"model": "vjepa2"}, tiny=True, ui=True) as base:
        page, errors = _open(browser, base)
        assert page.eval_on_selector_all("#tabs button", "bs => bs.map(b => b.dataset.tab)") == ["latents"]
        page.set_input_files("#latents-file", {"name": "frame.png", "mimeType": "image/png", "buffer": _png(2)})
        page.click("#latents-form button")
        _done(page, "latents-form")
        size = page.eval_on_selector("#latents-out canvas.plot", "c => [c.width, c.height]")
        assert size[0] > 0 and size[1] > 0
        page.screenshot(path=tmp_path / "latents.png")
        assert errors == []
        values = np.array([1.0, -2.5, 3.1415927, -1e-20, 6e4], np.float32)  # the page reads raw bfloat16 as Python does
        chunk = TensorChunk.from_array("latents", 0, values, True, "bfloat16").model_dump()
        read = page.evaluate("c => import('/playground/media.js').then((m) => m.tensorValues(c))", chunk)
        np.testing.assert_array_equal(np.asarray(read, np.float32), TensorChunk.model_validate(chunk).to_numpy())


def test_api_key_field_reaches_a_guarded_server(browser, tmp_path) -> None:
    with running_server({"model": "toy"}, api_key="s3cret", ui=True) as base:
        page = browser.new_page()
        page.goto(base + "/")  # the page itself is open; its requests need the key
        page.wait_for_function("document.querySelector('#status').textContent.includes('API key')")
        page.fill("#api-key", "s3cret")
        page.dispatch_event("#api-key", "change")
        page.wait_for_selector("#tabs button")
        assert page.text_content("#model-name") == "toy"
