"""Before it accepts a request the server does the request path's one-time work, so the first request does
not pay for it: starting the worker-thread pool that requests build their inputs in (anyio imports and
starts its thread backend on first use: ~0.35 s of a --tiny Orpheus server's first time to audio on the dev
machine), the processor's `warm` (jinja2 and the chat template's compile, the tokenizer's first call) and
the encoders of the model's output media (`warm_encoders`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from mstar.models.common.chat_template import compile_template
from mstar.models.common.text import Tokenizer
from mstar.server import app as app_module
from tests.e2e.server_thread import running_server


def _app_with(processor, outputs: tuple[str, ...] = ("text",)) -> SimpleNamespace:
    runtime = SimpleNamespace(processor=processor, model=SimpleNamespace(output_modalities=outputs))
    return SimpleNamespace(state=SimpleNamespace(mstar=SimpleNamespace(runtime=runtime)))


def _start(app) -> None:
    async def go() -> None:
        async with app_module._warm_lifespan(app):
            pass

    asyncio.run(go())


def test_lifespan_warms_the_processor_in_the_thread_pool(monkeypatch):
    pooled, warmed = [], []

    async def recording(fn, *args):
        pooled.append(fn)
        return fn(*args)

    monkeypatch.setattr(app_module, "run_in_threadpool", recording)
    _start(_app_with(SimpleNamespace(warm=lambda: warmed.append(1), sample_rate=24000)))
    assert warmed == [1] and len(pooled) == 1


def test_a_failing_warm_does_not_stop_the_server(caplog):
    def broken() -> None:
        raise RuntimeError("no tokenizer today")

    _start(_app_with(SimpleNamespace(warm=broken, sample_rate=24000)))  # returns: startup goes on
    assert "warming the request path failed" in caplog.text


def test_lifespan_warms_the_encoders_of_the_models_outputs(monkeypatch):
    """A speech model's server encodes silence once in every audio format before it serves (a fresh
    process's first aac encode took 52-66 ms on the dev machine, 9-13 warmed); a text model's encodes nothing."""
    from mstar.server.media import encode

    seen = []
    real_audio, real_video = encode.encode_audio, encode.encode_video
    monkeypatch.setattr(encode, "encode_audio", lambda x, rate, fmt: seen.append((fmt, rate)) or real_audio(x, rate, fmt))
    monkeypatch.setattr(encode, "encode_video", lambda *a, **k: seen.append(("mp4", None)) or real_video(*a, **k))
    processor = SimpleNamespace(warm=lambda: None, sample_rate=22050)
    _start(_app_with(processor))
    assert seen == []
    _start(_app_with(processor, ("audio",)))
    assert seen == [(fmt, 22050) for fmt in encode.AUDIO_FORMATS]
    seen.clear()
    _start(_app_with(processor, ("video", "image")))
    assert seen == [("mp4", None)]


def test_an_encoder_that_fails_to_warm_is_left_cold(monkeypatch, caplog):
    from mstar.server.media import MediaError, encode

    def no_mp3(x, rate, fmt):
        if fmt == "mp3":
            raise MediaError(500, "no mp3 encoder here")
        return b""

    monkeypatch.setattr(encode, "encode_audio", no_mp3)
    with caplog.at_level("INFO"):
        took = encode.warm_encoders(("audio",), 24000)
    assert "mp3" not in took and set(took) == set(encode.AUDIO_FORMATS) - {"mp3"}
    assert "warming the mp3 encoder failed" in caplog.text


def test_served_app_warms_at_startup(monkeypatch):
    used = []
    real = app_module.run_in_threadpool

    async def recording(fn, *args):
        used.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(app_module, "run_in_threadpool", recording)
    with running_server({"model": "toy"}):
        assert len(used) == 1, "the app did not warm its request path before serving"


def test_tokenizer_warm_compiles_its_chat_templates():
    from mstar.models.llama.tiny import tiny_tokenizer_folder

    tok = Tokenizer.from_pretrained(tiny_tokenizer_folder())
    assert tok.config.chat_templates
    compile_template.cache_clear()
    tok.warm()
    assert compile_template.cache_info().currsize == len(tok.config.chat_templates)
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert compile_template.cache_info().hits >= 1 and compile_template.cache_info().misses == len(
        tok.config.chat_templates)


def test_model_processors_warm_their_tokenizers(monkeypatch):
    """The text, Orpheus and Qwen3-Omni processors warm through their tokenizer (tiny configs, offline)."""
    from mstar.models.registry import get_model_class

    warmed = []
    real = Tokenizer.warm
    monkeypatch.setattr(Tokenizer, "warm", lambda self: warmed.append(self) or real(self))
    for name in ("qwen3", "orpheus", "qwen3_omni"):
        cls = get_model_class(name)
        cls(cls.make_config(tiny=True)).processor().warm()
    assert len(warmed) == 3
