"""2D Darcy flow, the FNO benchmark: -div(a grad u) = f on the unit square, u = 0 on the edge.

The permeability a(x) is a thresholded Gaussian random field (Li et al., "Fourier Neural
Operator for Parametric PDEs", 2021): psi ~ N(0, (-Laplacian + tau^2 I)^(-alpha)) with Neumann
boundary conditions, sampled by an inverse DCT, then a = a_high where psi >= 0 and a_low
elsewhere. The equation is discretised on the `grid x grid` nodes of [0, 1]^2 (edge nodes
included) by the 5-point finite-difference stencil with harmonic-mean face coefficients,
and the interior system is solved by a sparse direct factorization (SuperLU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from spmd.data.formats.field_files import FieldsInfo, solver_attrs, write_fields
from spmd.errors import SpmdError

# scipy is imported where a field is sampled or solved: every rank imports this module (the
# FNO task's data), and only the rank that makes the dataset needs scipy (0.3 s per import).

SOLVER_NAME = "fd5-harmonic-superlu"
GENERATOR_VERSION = 1   # bump when the same parameters would give different samples


@dataclass(frozen=True)
class DarcyParams:
    """Generating parameters; `data.solver.<name>` in the config overrides each default."""

    alpha: float = 2.0      # smoothness of the random field
    tau: float = 3.0        # inverse length scale of the random field
    a_high: float = 12.0    # permeability where the field is >= 0
    a_low: float = 3.0      # permeability where the field is < 0
    forcing: float = 1.0    # constant source term f

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DarcyParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SpmdError(
                f"unknown key data.solver.{unknown[0]}; the Darcy generator knows "
                f"{', '.join(sorted(known))}"
            )
        try:
            params = cls(**{k: float(v) for k, v in values.items()})
        except (TypeError, ValueError) as e:
            raise SpmdError(f"data.solver: values must be numbers ({e})") from None
        if params.a_low <= 0 or params.a_high <= 0:
            raise SpmdError("data.solver.a_low and data.solver.a_high must be positive")
        if params.tau <= 0 or params.alpha <= 0:
            raise SpmdError("data.solver.alpha and data.solver.tau must be positive")
        return params

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def random_permeability(rng: np.random.Generator, grid: int, p: DarcyParams) -> np.ndarray:
    """A thresholded Gaussian random field on `grid x grid` nodes (values a_low / a_high)."""
    k1, k2 = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    coef = p.tau ** (p.alpha - 1) * (np.pi**2 * (k1**2 + k2**2) + p.tau**2) ** (-p.alpha / 2)
    spectrum = grid * coef * rng.standard_normal((grid, grid))
    spectrum[0, 0] = 0.0
    import scipy.fft

    psi = scipy.fft.idctn(spectrum, type=2, norm="ortho")
    return np.where(psi >= 0, p.a_high, p.a_low)


def _harmonic(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return 2.0 * a * b / (a + b)


def darcy_matrix(a: np.ndarray) -> Any:
    """The SPD 5-point operator for -div(a grad .) on the interior nodes (row-major order),
    a scipy.sparse.csc_matrix."""
    import scipy.sparse

    g = a.shape[0]
    n = g - 2
    h2 = (1.0 / (g - 1)) ** 2
    ax = _harmonic(a[:-1, :], a[1:, :])   # face between (i, j) and (i+1, j): (g-1, g)
    ay = _harmonic(a[:, :-1], a[:, 1:])   # face between (i, j) and (i, j+1): (g, g-1)
    north = ax[:-1, 1:-1]                 # (i-1, j)-(i, j) for interior i, j: (n, n)
    south = ax[1:, 1:-1]
    west = ay[1:-1, :-1]
    east = ay[1:-1, 1:]
    diag = (north + south + west + east).ravel() / h2
    # Couplings to interior neighbours only (edge neighbours are u = 0).
    right = -east.copy()
    right[:, -1] = 0.0                    # no coupling across the end of a row
    right = right.ravel()[:-1] / h2
    down = -south[:-1, :].ravel() / h2
    return scipy.sparse.diags(
        [diag, right, right, down, down], [0, 1, -1, n, -n], shape=(n * n, n * n), format="csc"
    )


def solve_darcy(a: np.ndarray, forcing: float = 1.0) -> np.ndarray:
    """u on the full `grid x grid` node set (zero on the edge) for permeability `a`."""
    g = a.shape[0]
    if a.shape != (g, g) or g < 3:
        raise ValueError(f"permeability must be square with grid >= 3, got shape {a.shape}")
    import scipy.sparse.linalg

    matrix = darcy_matrix(a.astype(np.float64))
    rhs = np.full((g - 2) * (g - 2), float(forcing))
    interior = scipy.sparse.linalg.spsolve(matrix, rhs, permc_spec="MMD_AT_PLUS_A")
    u = np.zeros((g, g))
    u[1:-1, 1:-1] = interior.reshape(g - 2, g - 2)
    return u


def darcy_residual(a: np.ndarray, u: np.ndarray, forcing: float = 1.0) -> float:
    """Max-norm residual of the discrete equation at the interior nodes (for checks)."""
    inner = u[1:-1, 1:-1].ravel()
    return float(np.max(np.abs(darcy_matrix(a) @ inner - forcing)))


def sample(seed: int, split: int, index: int, grid: int,
           params: DarcyParams) -> tuple[np.ndarray, np.ndarray]:
    """Sample `index` of split `split`: its own generator, so any subset can be regenerated."""
    rng = np.random.default_rng([seed, split, index])
    a = random_permeability(rng, grid, params)
    return a, solve_darcy(a, params.forcing)


@dataclass(frozen=True)
class DarcySampler:
    """(split id, index) -> (a, u); picklable, so worker processes can share the work."""

    seed: int
    grid: int
    params: DarcyParams

    def __call__(self, split_id: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        return sample(self.seed, split_id, index, self.grid, self.params)


def make_darcy_dataset(path: Path, *, grid: int, num_train: int, num_test: int, seed: int,
                       solver: Mapping[str, Any], workers: int = 1, in_threads: bool = False,
                       compression: str | None = None, progress=None) -> FieldsInfo:
    """Solve `num_train + num_test` random Darcy problems and write them to `path` atomically."""
    if grid < 4:
        raise SpmdError(f"model.grid={grid}: the Darcy generator needs grid >= 4")
    params = DarcyParams.from_mapping(solver)
    attrs = {"pde": "darcy2d", "seed": seed, "generator_version": GENERATOR_VERSION,
             **solver_attrs(SOLVER_NAME, params.as_dict())}
    return write_fields(path, DarcySampler(seed, grid, params), grid,
                        {"train": num_train, "test": num_test}, attrs, workers=workers,
                        in_threads=in_threads,
                        compression=compression, progress=progress)
