"""Flow-matching UniPC multistep scheduler (bh1/bh2 predictor-corrector) with per-request state.

Each request owns a `UniPCState` (its schedule, step index and the last x0 predictions). `step` reads
and advances only that state, so requests at different steps, with different step counts, share one
DiT batch and each applies its own slice of the output. The model predicts the flow velocity v; the
scheduler turns it into x0 = x - sigma * v and runs UniPC in log-SNR time (lambda = log(alpha / sigma),
alpha = 1 - sigma). Matches diffusers' UniPCMultistepScheduler with prediction_type="flow_prediction",
use_flow_sigmas=True, predict_x0=True.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class UniPCConfig:
    """The flow-matching UniPC multistep scheduler as Wan2.2 and Cosmos3 configure it (TI2V-5B: flow_shift 5)."""

    num_train_timesteps: int = 1000
    flow_shift: float = 5.0
    solver_order: int = 2
    solver_type: str = "bh2"  # "bh1" or "bh2"
    lower_order_final: bool = True  # drop to first order on the last steps
    disable_corrector: tuple[int, ...] = ()  # step indices whose corrector is skipped
    final_sigma_zero: bool = True  # final_sigmas_type "zero" (else "sigma_min")
    native_flow: bool = False  # base sigmas from 1 - 1/T down to 0 (Cosmos3's use_native_flow_schedule)

    def __post_init__(self) -> None:
        if self.solver_type not in ("bh1", "bh2"):
            raise ValueError(f"scheduler solver_type {self.solver_type!r} is not supported; use 'bh1' or 'bh2'")
        if self.solver_order < 1:
            raise ValueError(f"scheduler solver_order must be >= 1, got {self.solver_order}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> UniPCConfig:
        """Parse a diffusers scheduler_config.json; options not implemented here raise, naming the key."""
        required = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "predict_x0": True}
        for key, value in required.items():
            if cfg.get(key, value) != value:
                raise ValueError(f"scheduler {key}={cfg.get(key)!r} is not supported; use {key}={value!r}")
        for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_dynamic_shifting",
                    "thresholding", "shift_terminal", "solver_p"):
            if cfg.get(key):
                raise ValueError(f"scheduler option {key}={cfg[key]!r} is not supported; remove it")
        final = cfg.get("final_sigmas_type", "zero")
        if final not in ("zero", "sigma_min"):
            raise ValueError(f"scheduler final_sigmas_type {final!r} is not supported; use 'zero' or 'sigma_min'")
        return cls(
            num_train_timesteps=cfg.get("num_train_timesteps", 1000),
            flow_shift=float(cfg.get("flow_shift", 1.0)),
            solver_order=cfg.get("solver_order", 2),
            solver_type=cfg.get("solver_type", "bh2"),
            lower_order_final=bool(cfg.get("lower_order_final", True)),
            disable_corrector=tuple(cfg.get("disable_corrector") or ()),
            final_sigma_zero=final == "zero",
        )


@dataclass(frozen=True)
class FlowSchedule:
    """The timesteps a request visits and the noise level around each step."""

    timesteps: torch.Tensor  # [N] int64: what the DiT is conditioned on at step i
    sigmas: torch.Tensor  # [N + 1] float32: noise level before step i; sigmas[N] is the final level


def make_schedule(config: UniPCConfig, num_steps: int) -> FlowSchedule:
    """The shifted flow schedule: sigma = shift*s / (1 + (shift-1)*s), s from 1 down to 1/T, in float64."""
    if num_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_steps}")
    train_steps = config.num_train_timesteps
    if config.native_flow:
        sigmas = np.linspace(1 - 1 / train_steps, 0, num_steps + 1)[:-1]
    else:
        sigmas = np.linspace(1, 1 / train_steps, num_steps + 1)[:-1]
    sigmas = config.flow_shift * sigmas / (1 + (config.flow_shift - 1) * sigmas)
    if abs(sigmas[0] - 1) < 1e-6:
        sigmas[0] -= 1e-6  # sigma = 1 would make lambda = -inf at the first step
    timesteps = torch.from_numpy(sigmas * train_steps).to(torch.int64)  # truncated, as the reference does
    final = 0.0 if config.final_sigma_zero else sigmas[-1]
    all_sigmas = torch.from_numpy(np.concatenate([sigmas, [final]]).astype(np.float32))
    return FlowSchedule(timesteps=timesteps, sigmas=all_sigmas)


@dataclass
class UniPCState:
    """One request's scheduler state; advanced only by `step`."""

    config: UniPCConfig
    schedule: FlowSchedule
    step_index: int = 0
    model_outputs: list[torch.Tensor] = field(default_factory=list)  # last x0 predictions, oldest first
    last_sample: torch.Tensor | None = None  # the sample the previous predictor started from
    last_order: int = 0  # the previous predictor's order; the corrector reuses it

    @property
    def num_steps(self) -> int:
        """How many denoising steps this request runs."""
        return len(self.schedule.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        """The timestep of the current step (a 0-dim int64 tensor)."""
        return self.schedule.timesteps[self.step_index]

    @property
    def done(self) -> bool:
        """True once every step has been taken."""
        return self.step_index >= self.num_steps


def new_state(config: UniPCConfig, num_steps: int) -> UniPCState:
    """A fresh state for a request that denoises in `num_steps` steps."""
    return UniPCState(config=config, schedule=make_schedule(config, num_steps))


def step(state: UniPCState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Advance `state` one step: the less noisy sample from this step's velocity prediction.

    Corrects `sample` with the new prediction (UniC) when a previous step exists, then predicts the
    next sample (UniP). Only `state` changes; tensors passed in are not modified.
    """
    if state.done:
        raise ValueError(f"the scheduler already took all {state.num_steps} steps")
    config, index = state.config, state.step_index
    # The coefficients stay on the CPU, as 0-d tensors: a CUDA op takes them as scalar arguments. Moving
    # the sigmas to the GPU cost a blocking copy (the host waited for the DiT step queued before it) and
    # some forty one-element kernels and a linalg.solve, all while the GPU idled between DiT steps.
    sigmas = state.schedule.sigmas
    x0 = sample - sigmas[index] * model_output
    if index > 0 and (index - 1) not in config.disable_corrector and state.last_sample is not None:
        sample = _correct(state, x0, sigmas)
    state.model_outputs = (state.model_outputs + [x0])[-config.solver_order:]
    order = config.solver_order
    if config.lower_order_final:
        order = min(order, state.num_steps - index)
    order = min(order, len(state.model_outputs))  # warm-up: no more history than steps taken
    state.last_sample, state.last_order = sample, order
    prev = _predict(state, sample, sigmas, order)
    state.step_index += 1
    return prev


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    return torch.log(1 - sigma) - torch.log(sigma)


def _coefficients(config: UniPCConfig, sigma_t, sigma_s0, earlier: list[torch.Tensor], order: int):
    """(h_phi_1, B_h, R, b) of UniPC for a step sigma_s0 -> sigma_t; `earlier` are older sigmas."""
    h = _lambda(sigma_t) - _lambda(sigma_s0)
    rks = [(_lambda(s) - _lambda(sigma_s0)) / h for s in earlier] + [torch.ones((), device=h.device)]
    rks = torch.stack(rks)
    hh = -h  # x0-prediction form
    h_phi_1 = torch.expm1(hh)
    b_h = hh if config.solver_type == "bh1" else torch.expm1(hh)
    h_phi_k, factorial, rows, b = h_phi_1 / hh - 1, 1, [], []
    for i in range(1, order + 1):
        rows.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return h_phi_1, b_h, torch.stack(rows), torch.stack(b), rks


def _predict(state: UniPCState, x: torch.Tensor, sigmas: torch.Tensor, order: int) -> torch.Tensor:
    """UniP: extrapolate from sigmas[i] to sigmas[i+1] with the last `order` x0 predictions."""
    index, outputs = state.step_index, state.model_outputs
    sigma_t, sigma_s0 = sigmas[index + 1], sigmas[index]
    earlier = [sigmas[index - i] for i in range(1, order)]
    h_phi_1, b_h, rows, b, rks = _coefficients(state.config, sigma_t, sigma_s0, earlier, order)
    m0, alpha_t = outputs[-1], 1 - sigma_t
    x_t = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
    if order > 1:
        diffs = [(outputs[-(i + 1)] - m0) / rks[i - 1] for i in range(1, order)]
        if order == 2:
            rhos = torch.full((1,), 0.5, dtype=x.dtype)
        else:
            rhos = torch.linalg.solve(rows[:-1, :-1], b[:-1]).to(x.dtype)
        x_t = x_t - alpha_t * b_h * sum(r * d for r, d in zip(rhos, diffs, strict=True))
    return x_t.to(x.dtype)


def _correct(state: UniPCState, model_t: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """UniC: redo the previous step sigmas[i-1] -> sigmas[i] using this step's x0 prediction too."""
    index, outputs, order = state.step_index, state.model_outputs, state.last_order
    x = state.last_sample
    sigma_t, sigma_s0 = sigmas[index], sigmas[index - 1]
    earlier = [sigmas[index - (i + 1)] for i in range(1, order)]
    h_phi_1, b_h, rows, b, rks = _coefficients(state.config, sigma_t, sigma_s0, earlier, order)
    m0, alpha_t = outputs[-1], 1 - sigma_t
    if order == 1:
        rhos = torch.full((1,), 0.5, dtype=x.dtype)
    else:
        rhos = torch.linalg.solve(rows, b).to(x.dtype)
    diffs = [(outputs[-(i + 1)] - m0) / rks[i - 1] for i in range(1, order)]
    correction = sum((r * d for r, d in zip(rhos[:-1], diffs, strict=True)), torch.zeros_like(m0))
    x_t = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
    return (x_t - alpha_t * b_h * (correction + rhos[-1] * (model_t - m0))).to(x.dtype)
