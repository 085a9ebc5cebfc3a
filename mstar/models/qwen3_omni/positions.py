"""M-RoPE position ids of a Qwen3-Omni prompt (processor side; the reference's `get_rope_index`).

Text tokens advance all three rows together. An image or video block gets (t, h, w) grid
coordinates offset by the position where it starts (t in steps of `position_id_per_seconds` per
second of video); an audio block advances like text by its encoder output length. With
`use_audio_in_video`, a video's frames and its audio track are interleaved by time. Decode steps
continue at `index + delta`, delta = max position + 1 - prompt length (the engine does this by
itself once it has the prompt's explicit positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.models.qwen3_omni.config import MultimodalTokens


def audio_output_length(feature_len: int, n_window: int = 50) -> int:
    """Number of audio tokens the audio encoder makes from `feature_len` mel frames."""
    chunk = n_window * 2
    rest = (feature_len % chunk - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (feature_len // chunk) * 13


def _run(start: float, n: int) -> list[list[float]]:
    return [[start + i] * 3 for i in range(n)]


def _vision(start: float, grid: Sequence[int], merge: int, t_step: float) -> list[list[float]]:
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    return [[start + ti * t_step, start + hi, start + wi] for ti in range(t) for hi in range(h) for wi in range(w)]


def _interleave(video: list[list[float]], audio: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """Frames and audio merged by time; also the last piece the reference appends (sets the next start)."""
    out, v, a = [], 0, 0
    while v < len(video) and a < len(audio):
        if video[v][0] <= audio[a][0]:
            out.append(video[v])
            v += 1
        else:
            out.append(audio[a])
            a += 1
    tail = video[v:] + audio[a:]
    return out + tail, tail or out[-1:]


def mrope_positions(ids: Sequence[int] | torch.Tensor, tokens: MultimodalTokens,
                    image_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None = None,
                    video_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None = None,
                    audio_feature_lengths: Sequence[int] | torch.Tensor | None = None,
                    video_second_per_grid: Sequence[float] | torch.Tensor | None = None,
                    use_audio_in_video: bool = False) -> tuple[torch.Tensor, float]:
    """(positions [3, n], delta) of one prompt; int64 unless video timing makes them fractional.

    Like the reference, a prompt without image or video grids gets plain 0..n-1 positions.
    """
    ids = [int(t) for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
    if image_grid_thw is None and video_grid_thw is None:
        return torch.arange(len(ids)).expand(3, -1).clone(), 0
    images, videos = _rows(image_grid_thw), _rows(video_grid_thw)
    audios = [int(x) for x in _flat(audio_feature_lengths)]
    seconds = [float(x) for x in _flat(video_second_per_grid)]
    rows: list[list[float]] = []
    st, img, vid, aud, top = 0, 0, 0, 0, -1.0  # top: max of the last piece appended
    while True:
        vs = _find(ids, tokens.vision_start_token_id, st) if img < len(images) or vid < len(videos) else None
        as_ = _find(ids, tokens.audio_start_token_id, st) if aud < len(audios) else None
        if vs is None and as_ is None:
            break
        first = min(x for x in (vs, as_) if x is not None)
        in_video = first == vs and use_audio_in_video and as_ == vs + 1
        bos = 2 if in_video else 1
        rows += _run(top + 1, first - st + bos)
        nxt = top + 1 + first - st + bos
        if first == as_ and not in_video:
            n_audio = audio_output_length(audios[aud], tokens.audio_n_window)
            block = last = _run(nxt, n_audio)
            aud += 1
        elif ids[first + 1] == tokens.image_token_id:
            block = last = _vision(nxt, images[img], tokens.spatial_merge_size, tokens.position_id_per_seconds)
            img += 1
        else:
            step = (seconds[vid] if seconds else 1.0) * tokens.position_id_per_seconds
            block = last = _vision(nxt, videos[vid], tokens.spatial_merge_size, step)
            if in_video:
                n_audio = audio_output_length(audios[aud], tokens.audio_n_window)
                block, last = _interleave(block, _run(nxt, n_audio))
                aud += 1
            vid += 1
        rows += block
        top = max(max(r) for r in last) if last else nxt - 1
        rows += _run(top + 1, bos)
        top += bos
        st = first + bos + len(block) + bos
    if st < len(ids):
        rows += _run(top + 1, len(ids) - st)
    pos = torch.tensor(rows, dtype=torch.float64).T
    delta = float(pos.max()) + 1 - len(ids)
    if bool((pos == pos.round()).all()):
        return pos.long(), int(delta)
    return pos.float(), delta


def _find(ids: list[int], token: int, start: int) -> int | None:
    try:
        return ids.index(token, start)
    except ValueError:
        return None


def _rows(grids: Sequence[Sequence[int]] | torch.Tensor | None) -> list[list[int]]:
    if grids is None:
        return []
    return [[int(x) for x in g] for g in (grids.tolist() if isinstance(grids, torch.Tensor) else grids)]


def _flat(values: Sequence[float] | torch.Tensor | None) -> list[float]:
    if values is None:
        return []
    return list(values.tolist() if isinstance(values, torch.Tensor) else values)
