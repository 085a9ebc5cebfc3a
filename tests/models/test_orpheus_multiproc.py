"""Orpheus across processes with the vocoder on a second worker (mstar/configs/orpheus_disaggregated.yaml):
the same audio as in-process on one worker, streamed in order."""

from __future__ import annotations

import numpy as np
import pytest

from mstar.runtime.offline import MStar
from tests.models.orpheus_testing import yaml_config

pytestmark = pytest.mark.slow  # two worker processes: about a minute on 2 busy CPU cores

OPTS = {"max_tokens": 120, "seed": 3, "voice": "dan"}


def test_disaggregated_multiproc_audio_equals_inproc():
    with MStar("orpheus", config=yaml_config("orpheus"), tiny=True) as m:
        expected = np.concatenate(m.generate({"text": "Across workers."}, **OPTS).outputs["audio"])
    with MStar("orpheus", config=yaml_config("orpheus_disaggregated"), tiny=True, mode="multiproc") as m:
        handle = m.submit({"text": "Across workers."}, **OPTS)
        pieces = [np.asarray(e.value) for e in handle if e.name == "audio"]
        alone = np.concatenate(m.generate({"text": "Across workers."}, **OPTS).outputs["audio"])
    streamed = np.concatenate(pieces)
    assert len(pieces) > 5 and streamed.size == 120 // 7 * 2048
    np.testing.assert_array_equal(streamed, alone)  # same process layout, same batch: bit-identical
    np.testing.assert_allclose(streamed, expected, rtol=0, atol=1e-5)
