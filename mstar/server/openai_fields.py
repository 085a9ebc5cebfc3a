"""What the OpenAI routes do with each field of a request, checked before the model's request starts.

A field OpenAI defines for the route is built by it (`temperature`, `size`, `n`, ...), or named in `NOT_BUILT`:
accepted at the values that ask for nothing (`store: false`, an empty `logit_bias`) and refused at any other. A
field the route passes to the model as an option of its name (`temperature`, `seed`, `size`, `language`) is
refused when the model does not take it, so a toy request with `temperature` is not answered as if it had
sampled. Any other field is a model option (`extra_body`), refused unless the model takes it
(`Model.accepted_options`); the answer names the field, the closest name the request could have meant and
what the route and the model take.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from mstar.server.adapters import RequestError

if TYPE_CHECKING:
    from mstar.server.app import ServerState


def _unset(value: Any) -> bool:
    return not value  # None, false, 0, "" and empty lists or objects ask for nothing


def _any(value: Any) -> bool:
    return True


# Fields OpenAI's API defines for a route that the server does not build: what a value that asks for nothing
# looks like (accepted, dropped) and why any other value is refused.
_CHAT_NOT_BUILT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (_unset, "the server keeps no completions"),
    "metadata": (_unset, "it tags stored completions, and the server stores none"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "every request is served in one tier"),
    "reasoning_effort": (_unset, "models here take their own options for thinking, if any"),
    "verbosity": (_unset, "the answer's length is set by max_tokens"),
    "web_search_options": (_unset, "the server searches nothing"),
    "prediction": (_unset, "predicted outputs are not built"),
    "moderation": (_unset, "the server moderates nothing"),
    "functions": (_unset, "use tools"),
    "function_call": (_unset, "use tool_choice"),
    "logit_bias": (_unset, "logit biases are not built"),
    # an end user's id and prompt-cache hints: like `user`, they change no answer (the prefix cache needs no key)
    "safety_identifier": (_any, ""),
    "prompt_cache_key": (_any, ""),
    "prompt_cache_options": (_any, ""),
    "prompt_cache_retention": (_any, ""),
}
_IMAGES_NOT_BUILT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (_unset, "images are answered whole"),
    "partial_images": (_unset, "images are answered whole"),
    "moderation": (_unset, "the server moderates nothing"),
    "complexity": (_unset, "set num_inference_steps instead"),
    "frame_count": (_unset, "images are single frames; /v1/videos makes clips"),
    "frame_duration_ms": (_unset, "images are single frames; /v1/videos makes clips"),
    "svg": (_unset, "images are raster"),
    "safety_identifier": (_any, ""),
}
NOT_BUILT: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "/v1/chat/completions": _CHAT_NOT_BUILT,
    "/v1/completions": {"logit_bias": _CHAT_NOT_BUILT["logit_bias"]},
    "/v1/images/generations": _IMAGES_NOT_BUILT,
    "/v1/images/edits": {**_IMAGES_NOT_BUILT, "input_fidelity": (_unset, "edits follow the model's own fidelity"),
                         "markup": (_unset, "edits take a mask, not markup")},
    "/v1/audio/transcriptions": {
        "include": (_unset, "transcripts carry no logprobs"),
        "chunking_strategy": (_unset, "the file is transcribed whole"),
        "keywords": (_unset, "no model here is steered by keywords"),
        "languages": (_unset, "no model here is told its language"),
        "known_speaker_names": (_unset, "speakers are not told apart"),
        "known_speaker_references": (_unset, "speakers are not told apart"),
    },
}

# The route fields (OpenAI's and mstar's extensions of them) a route passes to the model as options of the
# same name: listed as a request may send them only where the model takes them.
OPTION_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "ignore_eos", "min_tokens", "stop", "instructions", "speed", "size", "seconds", "fps", "num_frames",
    "negative_prompt", "num_inference_steps", "guidance_scale", "language",
})


def model_options(state: ServerState, route: str, body: BaseModel, extras: Mapping[str, Any], from_fields: Mapping[str, Any],
                  owned: Collection[str] = ()) -> dict[str, Any]:
    """The model options of a request to `route`: `extras` (the fields OpenAI does not define) and `from_fields`
    (what the route made of OpenAI's), after checking both. `owned` are options the route sets itself, refused
    as fields. RequestError 400, naming the field, for an option in `from_fields` the model does not take, a
    value `NOT_BUILT` refuses, or an extra field that is neither one of the route's own nor a model option."""
    accepted = state.runtime.model.accepted_options()
    for name in from_fields:
        if name not in accepted:
            raise RequestError(400, f"model {state.model_name!r} does not take {name!r}; leave it out (its "
                                    f"options are {', '.join(sorted(accepted)) or 'none'})", name)
    not_built = NOT_BUILT.get(route, {})
    options: dict[str, Any] = {}
    for key, value in extras.items():
        if key in not_built:
            asks_nothing, why = not_built[key]
            if not asks_nothing(value):
                raise RequestError(400, f"{key}={value!r:.60} is not supported by {route} ({why}); leave it out",
                                   key)
        elif key in owned:
            raise RequestError(400, f"{route} sets {key!r} itself; leave it out", key)
        elif key not in accepted:
            raise RequestError(400, _unknown(state.model_name, route, body, key, accepted - set(owned)), key)
        else:
            options[key] = value
    return {**options, **from_fields}


def _unknown(model: str, route: str, body: BaseModel, key: str, accepted: Collection[str]) -> str:
    fields = sorted(name for name in type(body).model_fields if name not in OPTION_FIELDS or name in accepted)
    options = sorted(name for name in accepted if name not in fields)
    near = difflib.get_close_matches(str(key), fields + options, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return (f"unknown field {key!r}{hint}: neither OpenAI's {route} nor model {model!r} takes it. The route takes "
            f"{', '.join(fields)}; the model's options are {', '.join(options) or 'none'}")


def voice_option(state: ServerState, voice: str) -> dict[str, Any]:
    """`voice` as a model option where the model takes one; nothing for a model that speaks in one voice, since
    OpenAI's speech route and spoken chat require a voice name (its client always sends one)."""
    return {"voice": voice} if "voice" in state.runtime.model.accepted_options() else {}
