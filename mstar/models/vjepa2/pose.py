"""The robot state V-JEPA 2-AC conditions on, and how an action moves it.

A state is 7 numbers: end-effector position (3), orientation as extrinsic x-y-z Euler angles (3) and
gripper closure in [0, 1]. An action is a change of each: the position adds, the rotation composes
(the action's rotation applied after the state's), the gripper adds and is clipped to [0, 1].
"""

from __future__ import annotations

import torch


def euler_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """[..., 3] extrinsic x-y-z angles (radians) -> [..., 3, 3] rotation Rz @ Ry @ Rx."""
    cx, cy, cz = angles.cos().unbind(-1)
    sx, sy, sz = angles.sin().unbind(-1)
    rows = [
        [cz * cy, cz * sy * sx - sz * cx, cz * sy * cx + sz * sx],
        [sz * cy, sz * sy * sx + cz * cx, sz * sy * cx - cz * sx],
        [-sy, cy * sx, cy * cx],
    ]
    return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)


def matrix_to_euler(matrix: torch.Tensor) -> torch.Tensor:
    """[..., 3, 3] rotation -> [..., 3] extrinsic x-y-z angles, pitch in [-pi/2, pi/2]."""
    pitch = torch.atan2(-matrix[..., 2, 0], torch.hypot(matrix[..., 0, 0], matrix[..., 1, 0]))
    roll = torch.atan2(matrix[..., 2, 1], matrix[..., 2, 2])
    yaw = torch.atan2(matrix[..., 1, 0], matrix[..., 0, 0])
    return torch.stack([roll, pitch, yaw], dim=-1)


def next_state(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """[..., 7] state after [..., 7] action (module docstring), in float64 for the angles' sake."""
    s, a = state.double(), action.double()
    rotation = euler_to_matrix(a[..., 3:6]) @ euler_to_matrix(s[..., 3:6])
    gripper = (s[..., 6:] + a[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([s[..., :3] + a[..., :3], matrix_to_euler(rotation), gripper], dim=-1).to(state.dtype)
