"""Pi0.5's prompt: the task and the robot's state written as discrete tokens, and the state and action
normalisation from the checkpoint's statistics.

The state, normalised to [-1, 1] and zero-padded to `max_state_dim`, is cut into 256 equal bins and
written as the bins' numbers: "Task: pick up the cube, State: 128 131 ...;\\nAction: " (openpi's
`PaligemmaTokenizer.tokenize`; the tokenizer puts `<bos>` first). Values below -1 write -1, as numpy's
digitize does there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BINS = 256
_EDGES = np.linspace(-1, 1, BINS + 1)[:-1]  # the bins' lower edges, made once: a prompt is made per chunk


def discretize(state: np.ndarray) -> np.ndarray:
    """Bin numbers of a normalised state: 256 equal bins over [-1, 1)."""
    return np.digitize(state, bins=_EDGES) - 1


def prompt_text(task: str, state: np.ndarray, max_state_dim: int) -> str:
    """The prompt for `task` and a normalised `state` (padded with zeros to `max_state_dim`)."""
    padded = np.zeros(max_state_dim, dtype=np.float64)
    padded[:len(state)] = state
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, discretize(padded).tolist()))};\nAction: "


@dataclass(frozen=True)
class Quantiles:
    """lerobot's QUANTILES normalisation of one feature: q01 -> -1, q99 -> 1 (identity when absent)."""

    q01: np.ndarray | None = None
    q99: np.ndarray | None = None
    eps: float = 1e-8

    def _span(self) -> np.ndarray:
        span = self.q99 - self.q01
        return np.where(span == 0, self.eps, span)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        if self.q01 is None or self.q99 is None:
            return np.asarray(x, dtype=np.float64)
        return 2.0 * (x - self.q01) / self._span() - 1.0

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        if self.q01 is None or self.q99 is None:
            return np.asarray(x, dtype=np.float64)
        return (x + 1.0) * self._span() / 2.0 + self.q01
