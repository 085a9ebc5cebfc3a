"""The offline Python API: run a model in this process (or across processes) without a server.

    with MStar("toy") as m:
        result = m.generate({"text": "hi"}, max_tokens=8)
        print(result.outputs["text"])
"""

from __future__ import annotations

import dataclasses
import queue
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.conductor.request_state import FinishEvent, OutputEvent
from mstar.config import MStarConfig, config_from_dict, load_config
from mstar.models.base import OutputDecoder, check_option_names, check_option_support, check_option_types
from mstar.runtime.launcher import Runtime


class RequestFailed(RuntimeError):
    """A request ended with an error; `status` is an HTTP-style status code."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Result:
    """Everything one request produced: values per output name, in order."""

    outputs: dict[str, list[Any]] = field(default_factory=dict)
    finish_reason: str | None = None


class RequestHandle:
    """Iterate the events of one request; `cancel()` stops it everywhere. Events carry the values the
    workers emit (token ids as tensors, audio and frames as arrays); `decoded()` gathers them as the
    client sees them (text as str pieces), `result()` as emitted."""

    def __init__(self, runtime: Runtime, rid: str, decoder: OutputDecoder | None = None) -> None:
        self.runtime, self.rid = runtime, rid
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._decoder = decoder
        self.finish: FinishEvent | None = None

    def __iter__(self) -> Iterator[OutputEvent]:
        """Output events in arrival order; raises RequestFailed if the request fails."""
        while self.finish is None:
            event = self._events.get()
            if isinstance(event, FinishEvent):
                self.finish = event
                if event.error is not None:
                    raise RequestFailed(event.error, event.status)
                return
            yield event

    def cancel(self) -> bool:
        return self.runtime.cancel(self.rid)

    def result(self) -> Result:
        """Every emitted value, as the workers emitted it (see `decoded` for client values)."""
        result = Result()
        for event in self:
            result.outputs.setdefault(event.name, []).append(event.value)
        result.finish_reason = self.finish.finish_reason if self.finish else None
        return result

    def decoded(self) -> Result:
        """Run to the end; values decoded by the model's processor (text as str pieces), as `generate`
        returns them. A stop the decoder finds (a stop string) cancels the rest of the request."""
        if self._decoder is None:
            raise RuntimeError("this handle has no output decoder; get handles from MStar.submit")
        decoder, result = self._decoder, Result()
        for event in self:
            for name, value in decoder.push(event.name, event.value):
                result.outputs.setdefault(name, []).append(value)
            if decoder.finish_reason is not None:
                self.cancel()
                result.finish_reason = decoder.finish_reason
                break
        for name, value in decoder.flush():
            result.outputs.setdefault(name, []).append(value)
        if result.finish_reason is None:
            result.finish_reason = self.finish.finish_reason if self.finish else None
        return result


class MStar:
    """A model running in this process (mode "inproc"), across worker processes ("multiproc"), or with
    its workers as actors of the Ray cluster at `ray_address`."""

    def __init__(self, model: str | None = None, config: str | Path | dict | MStarConfig | None = None, *,
                 mode: str = "inproc", tiny: bool = False, load_format: str = "auto", model_path: str | None = None,
                 ray_address: str | None = None):
        """`model` (default: the config's, else "toy") overrides the config's model, as `mstar serve MODEL
        --config FILE` does."""
        override = {} if model is None else {"model": model}
        if config is None:
            config = config_from_dict({"model": model or "toy"})
        elif isinstance(config, (str, Path)):
            config = load_config(config, **override)
        elif isinstance(config, dict):
            config = config_from_dict({**config, **override})
        elif override:
            config = dataclasses.replace(config, **override)
        self.runtime = Runtime(config, mode=mode, tiny=tiny, load_format=load_format, model_path=model_path,
                               ray_address=ray_address)
        self.processor = self.runtime.processor

    def submit(self, request: dict[str, Any], request_id: str | None = None, **options: Any) -> RequestHandle:
        """Start a request; `options` override the model's per-request defaults."""
        if not isinstance(request, dict):
            raise TypeError(f"a request is a dict such as {{'text': 'hi'}}, got {type(request).__name__}")
        if request.get("text") is not None and not isinstance(request["text"], str):
            raise TypeError(f"request['text'] must be a string, got {type(request['text']).__name__}")
        rid = request_id or uuid.uuid4().hex
        model = self.runtime.model
        check_option_names(model.name, model.accepted_options(), options)
        check_option_types(model.default_options, options)
        check_option_support(model.name, self.processor, options)
        opts = self.runtime.model.request_options(options)
        self.processor.validate_options(opts)
        inputs = self.processor.inputs(request, opts)
        handle = RequestHandle(self.runtime, rid, self.processor.output_decoder(opts, {}))
        self.runtime.submit(rid, inputs, opts, handle._events.put)
        return handle

    def generate(self, request: dict[str, Any], **options: Any) -> Result:
        """Run one request to the end; values decoded by the model's processor (text as str pieces).
        For several at once, `submit` each and take `decoded()` of every handle."""
        return self.submit(request, **options).decoded()

    def close(self) -> None:
        self.runtime.shutdown()

    def __enter__(self) -> MStar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
