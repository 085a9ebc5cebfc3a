"""The prompt text the Cosmos3 generator was trained on, and its token ids.

An image or video prompt gets metadata sentences appended (duration and frame rate for a video, the
resolution), the negative prompt their negations; a policy prompt becomes the structured JSON action
caption instead. Each is rendered through the chat template (after the mode's system turn) and closed
with the end-of-turn and start-of-vision tokens, after which the generated tokens follow.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SYSTEM_IMAGE = "You are a helpful assistant who will generate images from a give prompt."  # [sic], as trained
SYSTEM_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."
VIEWPOINTS = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": "This video is captured from a third-person perspective looking towards the agent "
                         "from the front.",
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
}
_ASPECTS = ("1,1", "4,3", "3,4", "16,9", "9,16")


@dataclass(frozen=True)
class Shape:
    """What the metadata sentences describe: frames, size and frame rate of the output."""

    num_frames: int
    height: int
    width: int
    fps: float

    @property
    def is_image(self) -> bool:
        """One frame: an image prompt."""
        return self.num_frames == 1


def _append(base: str, addition: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def with_metadata(text: str, shape: Shape, negative: bool = False) -> str:
    """`text` with the duration (videos) and resolution sentences, negated for a negative prompt."""
    nota = "not " if negative else ""
    if not shape.is_image:
        seconds = shape.num_frames / shape.fps
        text = _append(text, f"The video is {nota}{seconds:.1f} seconds long and is {nota}of {shape.fps:.0f} FPS.")
    kind = "image" if shape.is_image else "video"
    return _append(text, f"This {kind} is {nota}of {shape.height}x{shape.width} resolution.")


def action_caption(description: str, shape: Shape, view_point: str | None) -> str:
    """The structured JSON caption of a policy request (task, framing, duration, fps, size, aspect)."""
    seconds = shape.num_frames / shape.fps if shape.fps > 0 else 0.0
    finite = seconds >= 0 and math.isfinite(seconds)
    duration, end = (int(seconds), round(seconds)) if finite else (0, 0)
    minutes, secs = divmod(end, 60)
    desc = description.strip()
    if desc and not desc.endswith((".", "!", "?")):
        desc = f"{desc}."
    caption: dict = {}
    framing = VIEWPOINTS.get(view_point) if view_point is not None else None
    if view_point is not None and framing is None:
        logger.warning("unknown view_point %r (known: %s); the caption has no framing", view_point, sorted(VIEWPOINTS))
    if framing:
        caption["cinematography"] = {"framing": framing}
    ratio = shape.width / shape.height if shape.height > 0 else 1.0
    aspect = min(_ASPECTS, key=lambda r: abs(int(r.split(",")[0]) / int(r.split(",")[1]) - ratio))
    caption["actions"] = [{"time": f"0:00-{minutes}:{secs:02d}", "description": desc}]
    caption["duration"] = f"{duration}s"
    caption["fps"] = float(shape.fps)
    caption["resolution"] = {"H": int(shape.height), "W": int(shape.width)}
    caption["aspect_ratio"] = aspect
    return json.dumps(caption)


def prompt_ids(tokenizer, text: str, is_image: bool, use_system_prompt: bool) -> list[int]:
    """Token ids of one prompt: the chat (system turn, user turn, generation prompt), then the end-of-turn
    and start-of-vision tokens. `tokenizer` is a `mstar.models.common.text.Tokenizer`."""
    messages = [{"role": "system", "content": SYSTEM_IMAGE if is_image else SYSTEM_VIDEO}] if use_system_prompt else []
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, add_vision_id=False)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    vision_start = tokenizer.token_to_id("<|vision_start|>")
    if vision_start is None or tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer lacks <|vision_start|> or an eos token; use the checkpoint's text_tokenizer/")
    return ids + [tokenizer.eos_token_id, vision_start]
