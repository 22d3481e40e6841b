"""2-D Kolmogorov flow: incompressible Navier-Stokes in vorticity form, pseudo-spectral.

On the periodic square [0, 2 pi)^2, for the vorticity w(x, y, t) (arrays `[..., x, y]`):

    dw/dt + u . grad w = nu lap w - drag w + f,    f = -k_f cos(k_f y),
    u = (d psi/dy, -d psi/dx),  -lap psi = w,      nu = 1 / reynolds,

f is the curl of the body force sin(k_f y) in x (Kolmogorov forcing). Space: Fourier
modes of `numpy.fft.rfft2`; the advection term is evaluated on the grid and its transform
truncated by the 2/3 rule (every mode with |k_x| or k_y >= grid / 3 is zero, in the state
too), so products do not alias. Time: the linear terms (viscosity, drag) are integrated
exactly through an integrating factor and the rest with classical RK4 (Lawson's IF-RK4),
at a fixed step `dt <= max_dt` that divides each output interval.

Invariants:
- Everything is vectorized over the leading axes (many trajectories at once), in float64,
  and a trajectory depends only on its own initial field: the same for any batch it is
  solved in (the step size is fixed, never adapted to the batch).
- `trajectories(count, seed, ...)` is a pure function of its arguments; its snapshots are
  `snapshot_dt` apart in time, the first one `spinup` after a random initial field.
- A single Fourier mode (of any wavenumber) without forcing is an exact steady solution of
  the nonlinear term, so it decays as exp(-(nu |k|^2 + drag) t): the test of the solver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft

TWO_PI = 2.0 * math.pi


@dataclass(frozen=True)
class KolmogorovFlow:
    """The equation and its discretization on a `grid` x `grid` periodic mesh.

    reynolds: 1 / viscosity; forcing_wavenumber: k_f (0: unforced); forcing_amplitude: of
    the body force; drag: linear damping rate; max_dt: the largest solver step (CFL: keep
    it below about dx / max|u|).
    """

    grid: int = 32
    reynolds: float = 100.0
    forcing_wavenumber: int = 4
    forcing_amplitude: float = 1.0
    drag: float = 0.1
    max_dt: float = 0.05

    def __post_init__(self) -> None:
        if self.grid < 8 or self.grid % 2:
            raise ValueError(f"grid={self.grid}: an even number of points >= 8 is needed")
        if self.reynolds <= 0 or self.max_dt <= 0 or self.drag < 0:
            raise ValueError("reynolds and max_dt must be > 0 and drag >= 0")

    @property
    def viscosity(self) -> float:
        return 0.0 if math.isinf(self.reynolds) else 1.0 / self.reynolds

    # ------------------------------------------------------------ spectral operators

    def wavenumbers(self) -> tuple[np.ndarray, np.ndarray]:
        """(k_x of shape (grid, 1), k_y of shape (1, grid // 2 + 1)), integers as floats."""
        n = self.grid
        return (np.fft.fftfreq(n, 1.0 / n)[:, None], np.fft.rfftfreq(n, 1.0 / n)[None, :])

    def dealias(self) -> np.ndarray:
        """The 2/3-rule mask of kept modes (grid, grid // 2 + 1)."""
        kx, ky = self.wavenumbers()
        cut = self.grid / 3.0
        return (np.abs(kx) < cut) & (ky < cut)

    def linear(self) -> np.ndarray:
        """The linear operator's symbol, -nu |k|^2 - drag, per mode."""
        kx, ky = self.wavenumbers()
        return -self.viscosity * (kx**2 + ky**2) - self.drag

    def coordinates(self) -> tuple[np.ndarray, np.ndarray]:
        """Grid point coordinates x (grid, 1) and y (1, grid) in [0, 2 pi)."""
        s = np.arange(self.grid) * (TWO_PI / self.grid)
        return s[:, None], s[None, :]

    def forcing(self) -> np.ndarray:
        """The vorticity forcing -A k_f cos(k_f y) on the grid, (grid, grid)."""
        x, y = self.coordinates()
        k = self.forcing_wavenumber
        f = -self.forcing_amplitude * k * np.cos(k * y)
        return np.broadcast_to(f, (self.grid, self.grid)) + 0.0 * x

    def velocity(self, w_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(u, v) on the grid of the vorticity's modes `w_hat` (..., grid, grid // 2 + 1)."""
        kx, ky = self.wavenumbers()
        k2 = kx**2 + ky**2
        psi_hat = w_hat / np.where(k2 == 0, 1.0, k2)
        n = self.grid
        return (fft.irfft2(1j * ky * psi_hat, s=(n, n)),
                fft.irfft2(-1j * kx * psi_hat, s=(n, n)))

    # ------------------------------------------------------------ time stepping

    def _operators(self, dt: float) -> dict[str, np.ndarray]:
        kx, ky = self.wavenumbers()
        k2 = kx**2 + ky**2
        inv_k2 = np.where(k2 == 0, 0.0, 1.0 / np.where(k2 == 0, 1.0, k2))
        lin, mask = self.linear(), self.dealias()
        # w_hat -> (u, v, dw/dx, dw/dy) in Fourier space, one broadcast product
        gradients = np.stack(np.broadcast_arrays(1j * ky * inv_k2, -1j * kx * inv_k2,
                                                 1j * kx + 0 * ky, 1j * ky + 0 * kx))
        return {"gradients": gradients, "mask": mask,
                "forcing": fft.rfft2(self.forcing()) * mask,
                "e": np.exp(lin * dt), "e2": np.exp(lin * dt / 2)}

    def _tendency(self, w_hat: np.ndarray, ops: dict[str, np.ndarray]) -> np.ndarray:
        """-(u . grad w) dealiased, plus the forcing, in Fourier space."""
        n = self.grid
        spectral = ops["gradients"].reshape((4,) + (1,) * (w_hat.ndim - 2) + (n, -1)) * w_hat
        u, v, wx, wy = fft.irfft2(spectral, s=(n, n))
        return ops["forcing"] - fft.rfft2(u * wx + v * wy) * ops["mask"]

    def advance(self, w_hat: np.ndarray, duration: float) -> np.ndarray:
        """The modes `w_hat` (..., grid, grid // 2 + 1) advanced by `duration` (IF-RK4)."""
        if duration <= 0:
            return w_hat
        steps = max(1, math.ceil(duration / self.max_dt - 1e-9))
        dt = duration / steps
        ops = self._operators(dt)
        e, e2 = ops["e"], ops["e2"]
        w = w_hat * ops["mask"]
        for _ in range(steps):
            a = self._tendency(w, ops)
            b = self._tendency(e2 * (w + 0.5 * dt * a), ops)
            c = self._tendency(e2 * w + 0.5 * dt * b, ops)
            d = self._tendency(e * w + dt * e2 * c, ops)
            w = e * w + (dt / 6.0) * (e * a + 2.0 * e2 * (b + c) + d)
        return w

    def solve(self, w0: np.ndarray, snapshots: int, snapshot_dt: float) -> np.ndarray:
        """`snapshots` grid fields `snapshot_dt` apart, the first being `w0` (..., grid,
        grid): an array (..., snapshots, grid, grid), float64."""
        n = self.grid
        w_hat = fft.rfft2(np.asarray(w0, dtype=np.float64)) * self.dealias()
        out = np.empty((*w_hat.shape[:-2], snapshots, n, n))
        for t in range(snapshots):
            if t:
                w_hat = self.advance(w_hat, snapshot_dt)
            out[..., t, :, :] = fft.irfft2(w_hat, s=(n, n))
        return out


# ---------------------------------------------------------------- initial fields


def random_vorticity(count: int, grid: int, rng: np.random.Generator, *,
                     peak_wavenumber: float = 4.0, rms: float = 1.0) -> np.ndarray:
    """`count` random smooth zero-mean vorticity fields (count, grid, grid) of the given
    rms: Gaussian Fourier coefficients with energy spectrum ~ k^4 exp(-2 (k/k0)^2), whose
    energy peaks near `peak_wavenumber` k0."""
    n = grid
    kx = np.fft.fftfreq(n, 1.0 / n)[:, None]
    ky = np.fft.rfftfreq(n, 1.0 / n)[None, :]
    k = np.sqrt(kx**2 + ky**2)
    # E(k) ~ k^4 exp(-2 (k/k0)^2); enstrophy density k^2 E(k) / (2 pi k) per mode
    amplitude = np.sqrt(k**5 * np.exp(-2.0 * (k / peak_wavenumber) ** 2))
    amplitude[0, 0] = 0.0
    coeff = rng.standard_normal((count, n, n // 2 + 1)) + 1j * rng.standard_normal(
        (count, n, n // 2 + 1))
    w = fft.irfft2(coeff * amplitude, s=(n, n))
    w -= w.mean(axis=(-2, -1), keepdims=True)
    return w * (rms / np.maximum(w.std(axis=(-2, -1), keepdims=True), 1e-30))


def trajectories(flow: KolmogorovFlow, count: int, seed: int, *, snapshots: int,
                 snapshot_dt: float, spinup: float, initial_rms: float = 4.0) -> np.ndarray:
    """`count` trajectories (count, snapshots, grid, grid) of vorticity, float64: random
    initial fields (from `seed`) run for `spinup` time units, then `snapshots` fields every
    `snapshot_dt`."""
    rng = np.random.default_rng(seed)
    w0 = random_vorticity(count, flow.grid, rng, rms=initial_rms)
    w_hat = flow.advance(fft.rfft2(w0) * flow.dealias(), spinup)
    start = fft.irfft2(w_hat, s=(flow.grid, flow.grid))
    return flow.solve(start, snapshots, snapshot_dt)


def enstrophy(w: np.ndarray) -> np.ndarray:
    """Mean of w^2 / 2 over the grid, per field (the leading axes)."""
    return 0.5 * np.mean(np.asarray(w) ** 2, axis=(-2, -1))


def energy(flow: KolmogorovFlow, w: np.ndarray) -> np.ndarray:
    """Mean kinetic energy (u^2 + v^2) / 2 over the grid, per field."""
    u, v = flow.velocity(fft.rfft2(np.asarray(w, dtype=np.float64)))
    return 0.5 * np.mean(u**2 + v**2, axis=(-2, -1))
