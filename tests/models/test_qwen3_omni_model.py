"""The served Qwen3-Omni (three lanes joined by streams) vs transformers' Qwen3OmniMoeForConditionalGeneration
with the same random weights (tiny, float32, greedy): text tokens, talker codes and audio."""

import pytest
import torch

from mstar.conductor.conductor import Conductor
from mstar.models.base import OptionError
from mstar.models.qwen3_omni.code2wav import Code2Wav
from mstar.runtime.offline import MStar
from tests.models.qwen3_omni_model_testing import (
    PROMPT,
    make_reference,
    outputs,
    reference_generate,
    runtime_config,
    submit_ids,
)

pytest.importorskip("transformers")

THINKER_TOKENS, TALKER_TOKENS = 8, 14


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("omni")
    reference = make_reference(folder)
    with MStar("qwen3_omni", config=runtime_config(), model_path=str(folder)) as mstar:
        yield reference, mstar


@pytest.fixture
def spies(monkeypatch):
    """Walks the conductor starts, and the (codes, new frames) chunks Code2Wav decodes."""
    walks, chunks = [], []
    start, run_batch = Conductor._start_walk, Code2Wav.run_batch

    def start_walk(self, req, name):
        walks.append(name)
        return start(self, req, name)

    def code2wav_batch(self, walk, node, inputs, options):
        chunks.extend((x["codes"].clone(), int(x["codes_new"])) for x in inputs)
        return run_batch(self, walk, node, inputs, options)

    monkeypatch.setattr(Conductor, "_start_walk", start_walk)
    monkeypatch.setattr(Code2Wav, "run_batch", code2wav_batch)
    return walks, chunks


def test_text_request_matches_reference_and_never_wakes_the_talker(setup, spies):
    reference, mstar = setup
    walks, chunks = spies
    with torch.no_grad():
        out = reference.thinker.generate(torch.tensor([PROMPT]), max_new_tokens=THINKER_TOKENS, do_sample=False,
                                         eos_token_id=PROMPT[4])
    want = out[0, len(PROMPT):].tolist()
    text, audio = outputs(submit_ids(mstar, PROMPT, temperature=0, max_tokens=THINKER_TOKENS))
    assert text == want
    assert audio.numel() == 0 and chunks == []
    assert set(walks) == {"prefill", "decode"} or walks == ["prefill"]


def test_spoken_request_matches_reference_text_codes_and_audio(setup, spies):
    reference, mstar = setup
    walks, chunks = spies
    want_text, want_codes, want_audio = reference_generate(reference, PROMPT, THINKER_TOKENS, TALKER_TOKENS)
    # the same talker.max_tokens as the reference's talker_max_new_tokens: as many frames
    handle = submit_ids(mstar, PROMPT, temperature=0, max_tokens=THINKER_TOKENS, modalities=["text", "audio"],
                        voice="Ethan", **{"talker.temperature": 0, "talker.max_tokens": TALKER_TOKENS})
    text, audio = outputs(handle)
    assert text == want_text
    assert {"talk", "vocode"} <= set(walks)
    codes = torch.cat([c[len(c) - new:] for c, new in chunks]).T  # the new frames of each chunk, in order
    assert len(chunks) > 1, "the codes should reach Code2Wav in several chunks"
    assert codes.tolist() == want_codes.tolist()
    torch.testing.assert_close(audio, want_audio, atol=1e-4, rtol=0)


def test_voice_is_checked_and_changes_the_speech(setup, spies):
    _reference, mstar = setup
    with pytest.raises(ValueError, match="Aiden.*Chelsie.*Ethan"):
        submit_ids(mstar, PROMPT, voice="Nobody")
    opts = dict(temperature=0, max_tokens=4, modalities=["text", "audio"], **{"talker.temperature": 0,
                                                                              "talker.max_tokens": 6})
    _, ethan = outputs(submit_ids(mstar, PROMPT, voice="Ethan", **opts))
    _, chelsie = outputs(submit_ids(mstar, PROMPT, voice="chelsie", **opts))
    assert ethan.shape == chelsie.shape and not torch.equal(ethan, chelsie)


def _reference_logprobs(reference, tokens: list[int]) -> list[torch.Tensor]:
    """The log-softmax of transformers' thinker logits before each of `tokens` (sampled after PROMPT)."""
    with torch.no_grad():
        logits = reference.thinker(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(PROMPT) + j - 1] for j in range(len(tokens))]


@pytest.mark.parametrize("spoken", [False, True])
def test_text_logprobs_are_the_reference_thinkers_log_softmax(setup, spoken):
    """Option logprobs gives each text token's and its top 3 from the thinker, with speech asked for or not
    (the model refused logprobs: its thinker emitted none)."""
    reference, mstar = setup
    speech = {"modalities": ["text", "audio"], "talker.temperature": 0, "talker.max_tokens": 6} if spoken else {}
    result = submit_ids(mstar, PROMPT, temperature=0, max_tokens=THINKER_TOKENS, logprobs=3, **speech).result()
    tokens = [int(t) for value in result.outputs["text"] for t in torch.as_tensor(value).reshape(-1)]
    assert len(tokens) == THINKER_TOKENS and (len(result.outputs.get("audio", [])) > 0) is spoken
    got = [result.outputs[name] for name in ("logprob", "top_ids", "top_logprobs")]
    assert all(len(values) == len(tokens) for values in got)
    for token, logprob, top_ids, top_logprobs, want in zip(tokens, *got, _reference_logprobs(reference, tokens),
                                                            strict=True):
        best = want.topk(3)
        torch.testing.assert_close(torch.as_tensor(logprob).reshape(()), want[token], atol=1e-4, rtol=0)
        assert torch.as_tensor(top_ids).tolist() == best.indices.tolist() and top_ids[0] == token  # greedy
        torch.testing.assert_close(torch.as_tensor(top_logprobs), best.values, atol=1e-4, rtol=0)


def test_logprobs_reach_no_component_but_the_thinker(setup):
    _reference, mstar = setup
    result = submit_ids(mstar, PROMPT, temperature=0, max_tokens=3, modalities=["text", "audio"],
                        **{"talker.temperature": 0, "talker.max_tokens": 4}).result()
    assert "logprob" not in result.outputs  # not asked
    with pytest.raises(OptionError, match="talker samples codec codes, not text") as refused:  # said why
        mstar.submit({"text": "hi"}, **{"talker.logprobs": 1})
    assert refused.value.option == "talker.logprobs"
