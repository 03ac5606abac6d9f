"""A small numerical solver to stream from: the 1-D heat equation with random parameters.

``u_t = alpha * u_xx`` on ``x in [0, 1]`` with ``u(0, t) = u(1, t) = 0``; the initial
condition is ``sum_k a_k sin(k pi x)`` for k = 1..3.  The parameters of one simulation are
``(alpha, a_1, a_2, a_3)``; its result is ``u(x, T)`` on a grid of ``points`` nodes, computed
with explicit finite differences (a stable time step).  A surrogate network learns
parameters -> solution.  Pure numpy: simulation codes are rarely written in torch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["exact_solution", "random_parameters", "solve"]

ALPHA_RANGE = (0.01, 0.1)
MODES = 3


def random_parameters(rng: np.random.Generator) -> np.ndarray:
    """``(alpha, a_1, a_2, a_3)``: a diffusivity and three sine amplitudes in [-1, 1]."""
    alpha = rng.uniform(*ALPHA_RANGE)
    amplitudes = rng.uniform(-1.0, 1.0, size=MODES)
    return np.concatenate([[alpha], amplitudes]).astype(np.float64)


def solve(parameters: np.ndarray, *, points: int = 32, final_time: float = 1.0) -> np.ndarray:
    """``u(x, final_time)`` at ``points`` evenly spaced nodes of [0, 1] (explicit Euler in time)."""
    alpha, amplitudes = float(parameters[0]), parameters[1:]
    x = np.linspace(0.0, 1.0, points)
    u = sum(a * np.sin((k + 1) * np.pi * x) for k, a in enumerate(amplitudes))
    u[0] = u[-1] = 0.0  # the boundary condition (sin(k pi) is 1e-16, not 0)
    dx = x[1] - x[0]
    steps = int(np.ceil(final_time * alpha / (0.4 * dx * dx)))  # alpha dt / dx^2 <= 0.4: stable
    dt = final_time / steps
    r = alpha * dt / (dx * dx)
    for _ in range(steps):
        u[1:-1] = u[1:-1] + r * (u[2:] - 2.0 * u[1:-1] + u[:-2])
    return np.asarray(u, dtype=np.float64)


def exact_solution(parameters: np.ndarray, *, points: int = 32, final_time: float = 1.0) -> np.ndarray:
    """The analytic solution ``sum_k a_k exp(-alpha (k pi)^2 T) sin(k pi x)``, to check :func:`solve`."""
    alpha, amplitudes = float(parameters[0]), parameters[1:]
    x = np.linspace(0.0, 1.0, points)
    return np.asarray(
        sum(
            a * np.exp(-alpha * ((k + 1) * np.pi) ** 2 * final_time) * np.sin((k + 1) * np.pi * x)
            for k, a in enumerate(amplitudes)
        ),
        dtype=np.float64,
    )


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    p = random_parameters(rng)
    error = np.abs(solve(p) - exact_solution(p)).max()
    print(f"parameters {np.round(p, 3)}; max |finite differences - exact| = {error:.2e}")
