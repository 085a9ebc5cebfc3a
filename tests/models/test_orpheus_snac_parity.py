"""Our SNAC decoder and the Orpheus vocoder component against the `snac` package (tiny config, float32)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from mstar.models.orpheus.snac import SnacConfig
from mstar.models.orpheus.tiny import TINY_SNAC
from mstar.models.orpheus.tokens import FRAME, OrpheusTokens
from mstar.models.orpheus.vocoder import OrpheusVocoder
from mstar.models.orpheus.weights import load_snac, read_snac_config

snac = pytest.importorskip("snac")
TOL = 1e-4


def _reference(cfg: SnacConfig, seed: int = 0):
    torch.manual_seed(seed)
    ref = snac.SNAC(**{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}).eval()
    with torch.no_grad():  # non-trivial Snake alphas and biases, so every parameter matters
        for name, p in ref.named_parameters():
            if name.endswith("alpha"):
                p.copy_(0.5 + torch.rand_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return ref


def _save(ref, cfg: SnacConfig, folder, old_names: bool = False):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(cfg)))
    state = ref.state_dict()
    if old_names:  # the pre-parametrization naming of older torch versions
        state = {k.replace("parametrizations.weight.original0", "weight_g")
                 .replace("parametrizations.weight.original1", "weight_v"): v for k, v in state.items()}
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def _codes(cfg: SnacConfig, batch: int, frames: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.codebook_size, (batch, frames * n), generator=gen) for n in (1, 2, 4)]


@pytest.mark.parametrize("old_names", [False, True])
def test_decoder_matches_snac_with_its_own_noise(tmp_path, old_names):
    ref = _reference(TINY_SNAC)
    folder = _save(ref, TINY_SNAC, tmp_path / "snac", old_names)
    ours = load_snac(read_snac_config(folder), folder, torch.device("cpu"))
    codes = _codes(TINY_SNAC, batch=3, frames=4)
    torch.manual_seed(5)
    with torch.no_grad():
        expected = ref.decode(codes)
    torch.manual_seed(5)  # same generator state: our noise blocks draw what the reference draws
    with torch.no_grad():
        got = ours(codes)
    assert got.shape == expected.shape == (3, 1, 4 * TINY_SNAC.samples_per_frame)
    assert (got - expected).abs().max() < TOL


def test_vocoder_windows_match_snac_decode(tmp_path, monkeypatch):
    """run_batch over stream windows == snac.decode of the same frames (with the vocoder's noise), sliced."""
    cfg = TINY_SNAC
    ref = _reference(cfg, seed=3)
    folder = _save(ref, cfg, tmp_path / "snac")
    tokens = OrpheusTokens(base=320, codebook_size=cfg.codebook_size, end_of_text=2, bos=None)
    vocoder = OrpheusVocoder(load_snac(read_snac_config(folder), folder, torch.device("cpu")), tokens)
    codes = _codes(cfg, batch=1, frames=9, seed=4)
    frames = torch.stack([codes[0][0].view(-1, 1)[:, 0], codes[1][0].view(-1, 2)[:, 0], codes[2][0].view(-1, 4)[:, 0],
                          codes[2][0].view(-1, 4)[:, 1], codes[1][0].view(-1, 2)[:, 1], codes[2][0].view(-1, 4)[:, 2],
                          codes[2][0].view(-1, 4)[:, 3]], dim=1)  # [9, 7] in Orpheus' place order
    stream = (frames + tokens.audio_offset + torch.arange(FRAME) * cfg.codebook_size).reshape(-1)
    # an ordinary window: frames 2..5, keeps frame 3
    item = {"codes": stream[14:42], "codes_new": torch.tensor(7), "codes_start": torch.tensor(14),
            "codes_final": torch.tensor(False)}
    tail = {"codes": stream[35:63], "codes_new": torch.tensor(0), "codes_start": torch.tensor(35),
            "codes_final": torch.tensor(True)}  # the recut last window: frames 5..8, emits 7 and 8
    got = vocoder.run_batch("vocode", "snac", [item, tail], [{}, {}])

    noises = iter([])

    def fake_randn(shape, **kwargs):  # the reference's noise blocks get the vocoder's table noise
        return next(noises)
    spf = cfg.samples_per_frame
    for out, first, keep in ((got[0], 2, slice(spf, 2 * spf)), (got[1], 5, slice(2 * spf, 4 * spf))):
        noises = iter(vocoder.noises(torch.tensor([first]), 4))
        monkeypatch.setattr(torch, "randn", fake_randn)
        with torch.no_grad():
            expected = ref.decode([c[:, first * n:(first + 4) * n] for c, n in zip(codes, (1, 2, 4))])[0, 0]
        monkeypatch.undo()
        assert out["audio"].shape == (keep.stop - keep.start,)
        assert (out["audio"] - expected[keep]).abs().max() < TOL


def test_out_of_range_codes_skip_the_window():
    tokens = OrpheusTokens(base=320, codebook_size=TINY_SNAC.codebook_size, end_of_text=2, bos=None)
    vocoder = OrpheusVocoder(load_snac(TINY_SNAC, None, torch.device("cpu")), tokens)
    good = tokens.audio_offset + 1 + torch.arange(FRAME).repeat(4) * tokens.codebook_size
    bad = good.clone()
    bad[3] += tokens.codebook_size  # code 64 at place 3: outside the 64-entry codebook
    meta = {"codes_new": torch.tensor(28), "codes_start": torch.tensor(0), "codes_final": torch.tensor(False)}
    out = vocoder.run_batch("vocode", "snac", [{"codes": good, **meta}, {"codes": bad, **meta}], [{}, {}])
    assert out[0]["audio"].shape == (2 * TINY_SNAC.samples_per_frame,) and out[1] == {}


KEPT_CONFIGS = [TINY_SNAC, SnacConfig(encoder_dim=4, decoder_dim=32, codebook_size=64, codebook_dim=4,
                                      encoder_rates=(2, 4, 4, 3), decoder_rates=(3, 4, 2, 4))]


@pytest.mark.parametrize("cfg", KEPT_CONFIGS, ids=["snac24k_rates", "odd_stride"])
def test_emitted_samples_equal_the_whole_decodes(cfg):
    """Decoding only samples [lo, hi) (each block on the span of its input they depend on) gives the whole
    decode's samples there; float64, so anything beyond rounding shows."""
    torch.manual_seed(0)
    ours = load_snac(cfg, None, torch.device("cpu")).double()
    tokens = OrpheusTokens(base=320, codebook_size=cfg.codebook_size, end_of_text=2, bos=None)
    vocoder = OrpheusVocoder(ours, tokens).double()
    codes, first = _codes(cfg, batch=2, frames=4, seed=6), torch.tensor([3, 11])
    spf = cfg.samples_per_frame
    with torch.no_grad():
        whole = ours(codes, vocoder.table_noise(first))
        assert whole.shape == (2, 1, 4 * spf)
        for lo, hi in ((spf, 2 * spf), (0, spf), (3 * spf, 4 * spf), (5, 17), (0, 4 * spf)):
            kept = ours(codes, vocoder.table_noise(first), emit=(lo, hi))
            assert kept.shape == (2, 1, hi - lo)
            assert (kept - whole[..., lo:hi]).abs().max() < 1e-12
        spans = ours.decoder.emit_spans(codes[2].shape[1], (spf, 2 * spf))
    block_steps = [codes[2].shape[1]]  # latent steps, then each block's output steps
    for rate in cfg.decoder_rates:
        block_steps.append(block_steps[-1] * rate)
    # with SNAC 24 kHz's rates the later blocks run on under half their input (the saving), the first on most
    if cfg is not TINY_SNAC:
        return
    assert len(spans) == len(block_steps) and spans[0][1] - spans[0][0] > block_steps[0] // 2
    assert all(b - a < block_steps[i] // 2 for i, (a, b) in enumerate(spans) if i >= 1)


def test_a_span_one_step_short_changes_the_emitted_samples(monkeypatch):
    """The spans are no wider than needed: one input step fewer for any block changes the emitted samples."""
    from mstar.models.orpheus.snac import DecoderBlock

    cfg = TINY_SNAC
    torch.manual_seed(0)
    ours = load_snac(cfg, None, torch.device("cpu")).double()
    tokens = OrpheusTokens(base=320, codebook_size=cfg.codebook_size, end_of_text=2, bos=None)
    vocoder = OrpheusVocoder(ours, tokens).double()
    codes, first, spf = _codes(cfg, batch=1, frames=4, seed=6), torch.tensor([3]), cfg.samples_per_frame
    exact = DecoderBlock.input_span
    blocks = [m for m in ours.decoder.model if isinstance(m, DecoderBlock)]
    with torch.no_grad():
        whole = ours(codes, vocoder.table_noise(first))[..., spf: 2 * spf]
        for short in blocks[1:]:  # the first block's span reaches the window's ends: nothing to cut there
            for side in (0, 1):
                def narrower(self, lo, hi, in_len, short=short, side=side):
                    a, b = exact(self, lo, hi, in_len)
                    return (a + 1, b) if self is short and side == 0 else (a, b - 1) if self is short else (a, b)
                monkeypatch.setattr(DecoderBlock, "input_span", narrower)
                kept = ours(codes, vocoder.table_noise(first), emit=(spf, 2 * spf))
                monkeypatch.setattr(DecoderBlock, "input_span", exact)
                assert (kept - whole).abs().max() > 1e-9, (blocks.index(short), side)
