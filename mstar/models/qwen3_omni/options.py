"""Per-request options of Qwen3-Omni: one namespace per sampled component.

`thinker.*` reach the thinker, `talker.*` the talker (the worker strips the prefix, see
`ComponentSpec.option_namespace`), `code_predictor.*` the code predictor. A plain sampling key
(`temperature`, `max_tokens`, ... as the OpenAI routes send them) is the thinker's: it becomes
`thinker.<key>` unless the request also sets that one. Defaults follow the reference's `generate`
(talker: temperature 0.9, top_k 50, top_p 1.0, repetition_penalty 1.05, max_tokens 4096, which speaks
at most 4095 frames as the reference's talker_max_new_tokens does;
code predictor: top_k 50, top_p 0.8) and the checkpoint's generation_config.json for the thinker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from mstar.engines.sampling import SamplingParams
from mstar.models.base import OptionError

SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingParams))
NAMESPACES = ("thinker", "talker", "code_predictor")
MODALITIES = ("text", "audio")
# Set by the processor, never by the caller: the media kinds in the prompt (the thinker lane then starts
# with walk `prefill_media`).
MEDIA_OPTION = "media"

TALKER_DEFAULTS: dict[str, Any] = {
    "talker.temperature": 0.9, "talker.top_k": 50, "talker.top_p": 1.0, "talker.repetition_penalty": 1.05,
    "talker.max_tokens": 4096, "talker.return_hidden": -1,  # the code predictor reads the final state
}
CODE_PREDICTOR_DEFAULTS: dict[str, Any] = {"code_predictor.temperature": 1.0, "code_predictor.top_k": 50,
                                           "code_predictor.top_p": 0.8}
# the dotted options a request may set: the thinker's and the talker's sampling keys, the code predictor's
# (CodePredictorSampling's fields); `*.return_hidden` are set here, never by a request. Logprobs are the text's,
# asked for by the plain key alone (every route reads that one), so thinker.logprobs is no name; talker.logprobs
# is one only so that `validate` can refuse it with the reason.
NAMESPACED_OPTIONS = frozenset({f"{ns}.{key}" for ns in ("thinker", "talker") for key in SAMPLING_KEYS}
                               - {"thinker.logprobs"} | set(CODE_PREDICTOR_DEFAULTS) | {"code_predictor.seed"})


def resolve(defaults: Mapping[str, Any], options: Mapping[str, Any], accept_layer: int | None) -> dict[str, Any]:
    """The options every walk of a request sees: `defaults`, then the request's `options`.

    A speaking request's thinker also returns its layer-0 and `accept_layer` states (the talker's
    inputs); a greedy talker (talker.temperature 0) makes the code predictor greedy too unless the
    request says otherwise, as the reference does.
    """
    out = dict(defaults)
    for key, value in options.items():
        if key in SAMPLING_KEYS:
            if f"thinker.{key}" not in options:
                out[f"thinker.{key}"] = value
        else:
            out[key] = value
    if "audio" in (out.get("modalities") or ()) and accept_layer is not None:
        out["thinker.return_hidden"] = [0, accept_layer]
    if out.get("talker.temperature") == 0 and "code_predictor.temperature" not in options:
        out["code_predictor.temperature"] = 0.0
    return out


def scoped(options: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """What a component of `namespace` sees (the worker's `scoped_options`, for validation here)."""
    prefix = namespace + "."
    plain = {k: v for k, v in options.items() if "." not in k}
    return {**plain, **{k[len(prefix):]: v for k, v in options.items() if k.startswith(prefix)}}


def validate(options: Mapping[str, Any], speakers: Mapping[str, int]) -> None:
    """Raise ValueError naming a bad option (sampling values, modalities, voice, unknown namespaces)."""
    from mstar.models.qwen3_omni.code_predictor_sampling import CodePredictorSampling

    for key in options:
        if "." in key and key.split(".", 1)[0] not in NAMESPACES:
            raise ValueError(f"unknown option {key!r}: namespaced options start with one of {list(NAMESPACES)}")
    if options.get("talker.logprobs") is not None:
        raise OptionError("talker.logprobs", "talker.logprobs: the talker samples codec codes, not text; only the "
                                             "text answer's tokens carry logprobs (option logprobs)")
    for namespace in ("thinker", "talker"):
        view = scoped(options, namespace)
        SamplingParams.from_options({k: v for k, v in view.items() if k in SAMPLING_KEYS}, SamplingParams())
    CodePredictorSampling.from_options(options)
    modalities = options.get("modalities") or ["text"]
    if isinstance(modalities, str) or not set(modalities) <= set(MODALITIES) or "text" not in modalities and \
            "audio" not in modalities:
        raise ValueError(f"modalities={modalities!r}: use ['text'] or ['text', 'audio'] (or ['audio'])")
    voice = str(options.get("voice") or "Ethan")
    if speakers and voice.lower() not in speakers:
        names = sorted(s.capitalize() for s in speakers)
        raise ValueError(f"unknown voice {voice!r}; this checkpoint's voices are {names}")
    if not isinstance(options.get("use_audio_in_video", True), bool):
        raise ValueError(f"use_audio_in_video={options['use_audio_in_video']!r}: use true or false")
    for key in ("thinker.max_tokens", "talker.max_tokens"):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key}={value!r}: use a positive integer")
