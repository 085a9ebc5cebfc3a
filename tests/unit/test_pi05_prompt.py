"""Pi0.5's prompt (the state as discrete tokens) and its quantile normalisation, by lerobot's rules (#39)."""

from __future__ import annotations

import numpy as np

from mstar.models.pi05.prompt import Quantiles, discretize, prompt_text


def test_bins_follow_numpy_digitize_over_256_equal_bins() -> None:
    state = np.array([-1.0, -0.9999, 0.0, 0.5, 0.99, 1.0, 1.5, -1.5])
    assert discretize(state).tolist() == [0, 0, 128, 192, 254, 255, 255, -1]


def test_prompt_writes_task_and_padded_state() -> None:
    text = prompt_text(" pick_up the\ncube ", np.array([0.0, -1.0]), max_state_dim=4)
    assert text == "Task: pick up the cube, State: 128 0 128 128;\nAction: "


def test_quantiles_map_q01_q99_to_the_unit_interval_and_back() -> None:
    q = Quantiles(np.array([0.0, 2.0, 5.0]), np.array([10.0, 4.0, 5.0]))
    x = np.array([0.0, 4.0, 5.0])
    assert np.allclose(q.normalize(x), [-1.0, 1.0, -1.0])  # a zero span divides by eps: q01 -> -1
    assert np.allclose(q.unnormalize(q.normalize(np.array([7.5, 3.0, 5.0]))), [7.5, 3.0, 5.0])
    assert np.array_equal(Quantiles().normalize(x), x)
