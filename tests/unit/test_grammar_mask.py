"""Constrained decoding's engine side without a grammar library: the `structured_outputs` option's form,
the logit mask, and a tiny Llama served with scripted matchers (each allows one token, then only eos)
sampling exactly the script, batched beside a free request and a request with a stop of its own."""

from __future__ import annotations

import json

import pytest
import torch

from mstar.engines.grammar import canonical_spec, mask_logits
from mstar.engines.sampling import SamplingParams
from mstar.models.llama.serving import DenseLM
from mstar.runtime.offline import MStar
from tests.models.llm_runtime_testing import token_ids


def test_structured_outputs_option_is_checked_and_keeps_key_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = canonical_spec({"json_schema": schema})
    assert list(json.loads(spec)["json_schema"]["properties"]) == ["b", "a"]  # generated in the schema's order
    assert SamplingParams.from_options({"structured_outputs": spec}, SamplingParams()).structured_outputs == spec
    assert not SamplingParams(temperature=0, structured_outputs=spec).argmax_only  # no argmax shortcut
    for bad in ({}, {"regex": ""}, {"choice": []}, {"json_object": False}, {"regex": "a", "choice": ["b"]},
                {"json_schema": True}, {"xml": "<a/>"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            SamplingParams.from_options({"structured_outputs": bad}, SamplingParams())


def test_mask_logits_keeps_only_allowed_tokens_of_listed_rows():
    logits = torch.zeros(3, 40)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # token 3
    bitmask[1, 1] = 1 << 2  # token 34
    out = mask_logits(logits, [0, 2], bitmask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[2]).nonzero().flatten().tolist() == [34]
    assert torch.isfinite(logits).all()  # a new tensor
    shifted = mask_logits(torch.zeros(1, 8), [0], bitmask[1:], offset=30)  # columns are ids 30..37
    assert torch.isfinite(shifted[0]).nonzero().flatten().tolist() == [4]


class Script:
    """A matcher that allows `tokens` in order, then only `eos`."""

    def __init__(self, tokens: list[int], eos: int) -> None:
        self.todo, self.eos, self.done = list(tokens), eos, False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        token = self.todo[0] if self.todo else self.eos
        bitmask[row, token // 32] |= 1 << (token % 32)

    def accept(self, token_id: int) -> bool:
        want = self.todo[0] if self.todo else self.eos
        if token_id != want:
            return False
        if self.todo:
            self.todo.pop(0)
        else:
            self.done = True
        return True

    def is_finished(self) -> bool:
        return self.done


class ScriptGrammars:
    """`Grammars` whose spec is {"choice": [one string of space-separated token ids]}."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def matcher(self, spec: str) -> Script:
        [ids] = json.loads(spec)["choice"]
        return Script([int(t) for t in ids.split()], self.eos)


@pytest.fixture
def served(monkeypatch):
    eos = {}

    def grammars(model):
        eos.setdefault("id", model.tokenizer.eos_token_id)
        return ScriptGrammars(eos["id"])

    monkeypatch.setattr(DenseLM, "grammars", property(grammars))
    with MStar("llama", config={"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 64}},
               tiny=True) as m:
        yield m, m.runtime.model.tokenizer.eos_token_id


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scripted_grammars_decide_every_token(served, temperature):
    m, eos = served
    scripts = [[17, 5, 99, 42], [8, 8, 8], [250]]
    handles = [m.submit({"text": "hello"}, temperature=temperature, seed=i, max_tokens=16,
                        structured_outputs={"choice": [" ".join(map(str, s))]}) for i, s in enumerate(scripts)]
    free = m.submit({"text": "hello"}, temperature=0.0, max_tokens=6, ignore_eos=True)
    for handle, script in zip(handles, scripts, strict=True):
        assert token_ids(handle) == [*script, eos]  # the grammar's end token closes the answer
    assert len(token_ids(free)) == 6
    with pytest.raises(Exception, match="structured_outputs"):  # the processor refuses a malformed spec
        m.submit({"text": "hello"}, structured_outputs={"choice": "17"})
