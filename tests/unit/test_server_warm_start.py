"""Before it accepts a request the server does the request path's one-time work, so the first request does
not pay for it: starting the worker-thread pool that requests build their inputs in (anyio imports and
starts its thread backend on first use: ~0.35 s of a --tiny Orpheus server's first time to audio on the dev
machine) and the processor's `warm` (jinja2 and the chat template's compile, the tokenizer's first call)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from mstar.models.common.chat_template import compile_template
from mstar.models.common.text import Tokenizer
from mstar.server import app as app_module
from tests.e2e.server_thread import running_server


def _app_with(processor) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(mstar=SimpleNamespace(runtime=SimpleNamespace(processor=processor))))


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
    _start(_app_with(SimpleNamespace(warm=lambda: warmed.append(1))))
    assert warmed == [1] and len(pooled) == 1


def test_a_failing_warm_does_not_stop_the_server(caplog):
    def broken() -> None:
        raise RuntimeError("no tokenizer today")

    _start(_app_with(SimpleNamespace(warm=broken)))  # returns: startup goes on
    assert "warming the request path failed" in caplog.text


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
