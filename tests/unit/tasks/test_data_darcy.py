"""The Darcy generator: a correct finite-difference solve, deterministic samples, and an
HDF5 file that appears atomically (a killed `spmd data make` leaves no file behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from spmd.data.formats.field_files import inspect_fields, write_fields
from spmd.errors import SpmdError
from spmd.tasks.darcy import (
    DarcyParams,
    darcy_matrix,
    darcy_residual,
    make_darcy_dataset,
    random_permeability,
    sample,
    solve_darcy,
)
from tests.helpers.env import REPO, clean_env
from tests.helpers.fno import sha256, tiny_config


def test_stencil_is_exact_for_a_quadratic_per_direction():
    """a = 1, u = x(1-x)y(1-y): the 5-point operator gives -Laplace u = 2[x(1-x) + y(1-y)]."""
    g = 17
    x = np.linspace(0, 1, g)
    xx, yy = np.meshgrid(x, x, indexing="ij")
    u = xx * (1 - xx) * yy * (1 - yy)
    f = 2 * (xx * (1 - xx) + yy * (1 - yy))
    got = darcy_matrix(np.ones((g, g))) @ u[1:-1, 1:-1].ravel()
    np.testing.assert_allclose(got, f[1:-1, 1:-1].ravel(), rtol=1e-10)


def test_poisson_converges_to_the_known_maximum():
    # -Laplace u = 1 on the unit square: max u = 0.07367 (series solution)
    assert solve_darcy(np.ones((65, 65))).max() == pytest.approx(0.07367, abs=2e-4)


def test_solution_properties_on_a_random_permeability():
    p = DarcyParams()
    a, u = sample(7, 0, 3, 32, p)
    assert set(np.unique(a)) == {p.a_low, p.a_high}
    assert darcy_residual(a, u) < 1e-9
    assert np.all(u[0] == 0) and np.all(u[-1] == 0) and np.all(u[:, 0] == 0)
    assert np.all(u[1:-1, 1:-1] > 0)                      # maximum principle, f > 0
    matrix = darcy_matrix(a).toarray()
    np.testing.assert_array_equal(matrix, matrix.T)       # harmonic means: symmetric
    np.testing.assert_allclose(solve_darcy(2 * a), u / 2, rtol=1e-10)   # linear in 1/a
    np.testing.assert_allclose(solve_darcy(a.T), u.T, rtol=1e-10, atol=1e-15)


def test_samples_are_deterministic_and_independent():
    p = DarcyParams()
    a1, u1 = sample(0, 0, 5, 16, p)
    a2, u2 = sample(0, 0, 5, 16, p)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(u1, u2)
    assert not np.array_equal(a1, sample(0, 1, 5, 16, p)[0])   # test split != train split
    fractions = [np.mean(random_permeability(np.random.default_rng(i), 32, p) == p.a_high)
                 for i in range(40)]
    assert 0.3 < np.mean(fractions) < 0.7


def test_unknown_solver_key_is_a_user_error():
    with pytest.raises(SpmdError, match="data.solver.sigma"):
        DarcyParams.from_mapping({"sigma": 1.0})


def test_file_layout_and_attributes(tmp_path):
    path = make_darcy_dataset(tmp_path / "d.h5", grid=16, num_train=20, num_test=6, seed=3,
                              solver={"a_high": 10}).path
    with h5py.File(path, "r") as f:
        assert f["train/a"].shape == (20, 16, 16) and f["test/u"].shape == (6, 16, 16)
        assert f["train/a"].chunks == (1, 16, 16)
        assert f.attrs["grid"] == 16 and f.attrs["seed"] == 3
        assert f.attrs["num_train"] == 20 and f.attrs["num_test"] == 6
        assert f.attrs["solver"] == "fd5-harmonic-superlu" and f.attrs["version"] == 1
        assert '"a_high": 10.0' in f.attrs["solver_params"]
        a, u = sample(3, 0, 11, 16, DarcyParams(a_high=10))
        np.testing.assert_allclose(f["train/a"][11], a)
        np.testing.assert_allclose(f["train/u"][11], u, rtol=1e-6)
    assert inspect_fields(path).counts == {"train": 20, "test": 6}


def test_solver_threads_and_processes_write_the_serial_file(tmp_path):
    """A rank that makes the data solves in threads (it must not fork), `spmd data make
    --workers` in processes: the bytes are the serial run's either way."""
    kw = dict(grid=16, num_train=40, num_test=8, seed=5, solver={})
    made = {name: make_darcy_dataset(tmp_path / f"{name}.h5", workers=workers,
                                     in_threads=threads, **kw).path
            for name, workers, threads in (("serial", 1, False), ("threads", 3, True),
                                           ("processes", 2, False))}
    with h5py.File(made["serial"]) as want:
        for name in ("threads", "processes"):
            with h5py.File(made[name]) as got:
                for key in ("train/a", "train/u", "test/a", "test/u"):
                    assert got[key][:].tobytes() == want[key][:].tobytes(), (name, key)
                assert dict(got["train"].attrs) == dict(want["train"].attrs), name


def test_failed_write_leaves_nothing(tmp_path):
    def failing(split, index):
        if index == 20:
            raise RuntimeError("solver blew up")
        return np.zeros((8, 8)), np.zeros((8, 8))

    with pytest.raises(RuntimeError):
        write_fields(tmp_path / "d.h5", failing, 8, {"train": 40, "test": 4}, {})
    assert list(tmp_path.iterdir()) == []


def test_killed_data_make_leaves_no_file(tmp_path):
    target = tmp_path / "big.h5"
    config = tiny_config(tmp_path, target)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spmd.cli", "data", "make", str(config), "model.grid=64",
         "data.num_train=4000"], env=clean_env(), cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 60
    while not any(p.name.startswith(".big.h5.tmp") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not target.exists()


def test_data_make_cli_is_idempotent_and_refuses_a_mismatch(tmp_path):
    from tests.helpers.env import run_spmd

    target = tmp_path / "d.h5"
    config = tiny_config(tmp_path, target)
    first = run_spmd("data", "make", str(config))
    assert first.returncode == 0, first.stderr
    digest = sha256(target)
    again = run_spmd("data", "make", str(config))
    assert again.returncode == 0 and "exists" in again.stdout
    wrong = run_spmd("data", "make", str(config), "model.grid=32")
    assert wrong.returncode != 0
    assert "model.grid=32" in wrong.stderr and "'grid'=16" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    assert sha256(target) == digest
