"""Orpheus token layout: the prompt format, the voices, and audio tokens -> SNAC codes.

Orpheus extends the Llama-3 vocabulary (128,256 ids) with `<custom_token_N>` = id 128256 + N.
Tokens 1..5 are markers (start/end of speech, start/end of human, start of AI); audio tokens start
at custom token 10. Seven audio tokens make one SNAC frame; the token at place p (0..6) of a frame
encodes code `id - audio_offset - p * codebook_size`. Layout of a frame (as the original decoder
reads it): [c0, c1a, c2a, c2b, c1b, c2c, c2d], i.e. level 0 takes place 0, level 1 places 1 and 4,
level 2 places 2, 3, 5 and 6.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mstar.layers.logit_windows import LogitWindows

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
DEFAULT_VOICE = "tara"
FRAME = 7  # audio tokens per SNAC frame
LLAMA3_VOCAB = 128256  # the first custom token of the full-size model


def _custom_token(n: int) -> property:
    """The id of `<custom_token_n>` in the layout (`base` + n)."""
    return property(lambda self: self.base + n, doc=f"The id of `<custom_token_{n}>`.")


@dataclass(frozen=True)
class OrpheusTokens:
    """Ids of the markers and audio tokens; `base` is the id of `<custom_token_0>`."""

    base: int = LLAMA3_VOCAB
    codebook_size: int = 4096  # SNAC codebook entries per level
    end_of_text: int = 128009  # Llama-3 <|eot_id|>
    bos: int | None = 128000  # <|begin_of_text|>, None when the tokenizer has none (tiny)

    start_of_speech = _custom_token(1)
    end_of_speech = _custom_token(2)
    start_of_human = _custom_token(3)
    end_of_human = _custom_token(4)
    start_of_ai = _custom_token(5)
    audio_offset = _custom_token(10)  # the first audio token

    @property
    def speakable_span(self) -> tuple[int, int]:
        """The contiguous ids [lo, hi) holding all the LM speaks: end of speech, then `span_markers`
        (never spoken), then every audio token."""
        return self.end_of_speech, self.audio_offset + FRAME * self.codebook_size

    @property
    def span_markers(self) -> tuple[int, int]:
        """The marker ids [lo, hi) inside `speakable_span` (custom tokens 3..9), never spoken."""
        return self.end_of_speech + 1, self.audio_offset

    @property
    def vocab_size(self) -> int:
        """The LM vocabulary this layout needs (audio tokens plus Orpheus' two trailing ids)."""
        return self.audio_offset + FRAME * self.codebook_size + 2

    def prompt_ids(self, text_ids: list[int]) -> list[int]:
        """[start of human] bos text [eot, end of human, start of AI, start of speech].

        `text_ids` is the tokenized `"{voice}: {text}"`; a bos is added when the tokenizer has one
        and did not put it there itself.
        """
        if self.bos is not None and (not text_ids or text_ids[0] != self.bos):
            text_ids = [self.bos, *text_ids]
        return [self.start_of_human, *text_ids, self.end_of_text, self.end_of_human, self.start_of_ai,
                self.start_of_speech]

    def place_windows(self, vocab_size: int) -> LogitWindows:
        """The head windows of frame-place decoding, over the columns of `speakable_span`: after an
        audio token of place p, the codes 1..codebook_size - 1 of place p + 1 (mod 7); after any other
        id (start of speech ends the prompt), those of place 0; end of speech is always scored.

        Every token said this way is one the original decoder keeps at the place it reads it for
        (`accept_audio_token`: its code there is positive and inside the codebook), so the places the LM
        is held to and the ones the vocoder counts stay the same. Code 0 is left out because that
        decoder drops it without advancing the place."""
        lo = self.end_of_speech
        size = self.codebook_size
        place_start = [self.audio_offset - lo + p * size + 1 for p in range(FRAME)]
        starts = torch.full((vocab_size,), place_start[0], dtype=torch.int32)
        for p in range(FRAME):
            first = self.audio_offset + p * size
            starts[first:first + size] = place_start[(p + 1) % FRAME]
        return LogitWindows(starts, size - 1, always=(self.end_of_speech - lo,))

    def code(self, token: int, place: int) -> int:
        """The SNAC code a token stands for at `place` (0..6) of a frame; may be out of range."""
        return token - self.audio_offset - (place % FRAME) * self.codebook_size


def accept_audio_token(tokens: OrpheusTokens, item: torch.Tensor, accepted: int) -> bool:
    """Stream filter of the LM -> vocoder edge: whether a generated token joins the audio frames.

    Mirrors the original decoder (orpheus_tts `tokens_decoder`): a token whose code at the next
    frame place (`accepted % 7`) is not positive is dropped and the place does not advance. That drops
    every text or marker token (end of speech included) and, as in the original, code 0 too.
    Codes >= codebook_size pass here; `window_is_valid` rejects the windows holding them.
    """
    # item() on the usual one-token item: it runs per generated token, and a reshape and an index cost more
    token = item.item() if item.numel() == 1 else int(item.reshape(-1)[0])
    return tokens.code(token, accepted) > 0


def split_levels(frame_tokens: torch.Tensor, tokens: OrpheusTokens) -> list[torch.Tensor]:
    """Tokens [B, 7F] -> SNAC codes per level [B, F], [B, 2F], [B, 4F], clamped into the codebook.

    Pure tensor ops (no host sync): safe inside a captured graph. Clamping only keeps rows that
    `window_is_valid` rejected from indexing out of range; their audio is discarded.
    """
    b = frame_tokens.shape[0]
    places = torch.arange(FRAME, device=frame_tokens.device)
    codes = frame_tokens.view(b, -1, FRAME) - tokens.audio_offset - places * tokens.codebook_size
    codes = codes.clamp(0, tokens.codebook_size - 1)
    # Slices and stacks only: an index list would be a host tensor copied inside a CUDA-graph capture.
    level2 = torch.stack([codes[:, :, 2], codes[:, :, 3], codes[:, :, 5], codes[:, :, 6]], dim=-1)
    return [codes[:, :, 0], codes[:, :, 1::3].reshape(b, -1), level2.reshape(b, -1)]


def window_is_valid(frame_tokens: list[int], tokens: OrpheusTokens) -> bool:
    """Whether every code of whole frames is inside the codebook; the original skips other windows.

    (The original tests `code > 4096`, letting 4096 through, one past a 4096-entry codebook; we
    reject it.)
    """
    return valid_windows(torch.tensor([frame_tokens], dtype=torch.long), tokens)[0]


def valid_windows(frame_tokens: torch.Tensor, tokens: OrpheusTokens) -> list[bool]:
    """`window_is_valid` of each row of host tokens [B, 7F] (whole frames), in three tensor ops."""
    b = frame_tokens.shape[0]
    codes = frame_tokens.view(b, -1, FRAME) - _place_bases(tokens.audio_offset, tokens.codebook_size)
    low, high = torch.aminmax(codes.view(b, -1), dim=1)
    size = tokens.codebook_size
    return [lo >= 0 and hi < size for lo, hi in zip(low.tolist(), high.tolist())]


@functools.lru_cache(maxsize=8)
def _place_bases(audio_offset: int, codebook_size: int) -> torch.Tensor:
    """The token id of code 0 at each place of a frame (a host tensor, made once)."""
    return audio_offset + torch.arange(FRAME) * codebook_size
