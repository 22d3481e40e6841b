"""examples/kolmogorov: the pseudo-spectral solver against exact solutions and invariants,
and the TrajectoryTask pieces that do not train (its files on disk, its rollout loss and
metrics with a stand-in model, its errors). Each test takes well under a second or two."""

from __future__ import annotations

import json
import math
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from examples.kolmogorov.solver import (
    KolmogorovFlow,
    energy,
    enstrophy,
    random_vorticity,
    trajectories,
)
from spmd.config.load import build_task, load_config
from spmd.data.formats.stores import ArrayDataError, Store
from spmd.errors import ConfigError
from spmd.tasks.trajectory_task import rollout_key

# ---------------------------------------------------------------- the solver


def test_a_single_fourier_mode_decays_exactly():
    """No forcing: cos(3x + 2y) is steady for the nonlinear term, so only nu and drag act."""
    flow = KolmogorovFlow(grid=32, reynolds=50.0, forcing_wavenumber=0, drag=0.1, max_dt=0.05)
    x, y = flow.coordinates()
    w0 = np.cos(3 * x + 2 * y) + 0.0 * y
    w = flow.solve(w0, 3, 0.7)
    for t in range(3):
        decay = math.exp(-(13 / 50.0 + 0.1) * 0.7 * t)
        np.testing.assert_allclose(w[t], w0 * decay, atol=1e-12)


def test_without_viscosity_drag_and_forcing_energy_and_enstrophy_are_conserved():
    flow = KolmogorovFlow(grid=32, reynolds=math.inf, forcing_wavenumber=0, drag=0.0,
                          max_dt=0.02)
    w0 = random_vorticity(2, 32, np.random.default_rng(0), peak_wavenumber=3.0, rms=1.0)
    w = flow.solve(w0, 3, 0.5)
    assert np.abs(w[:, -1] - w[:, 0]).max() > 0.1          # the flow did move
    for invariant in (enstrophy(w), energy(flow, w)):
        np.testing.assert_allclose(invariant, invariant[:, :1].repeat(3, axis=1), rtol=1e-6)


def test_weak_forcing_settles_on_the_laminar_kolmogorov_flow():
    """At low Reynolds number the flow from rest is w = -k cos(k y) / (nu k^2 + drag)."""
    flow = KolmogorovFlow(grid=16, reynolds=10.0, forcing_wavenumber=4, drag=0.1, max_dt=0.1)
    w = flow.solve(np.zeros((16, 16)), 2, 12.0)[-1]
    _, y = flow.coordinates()
    laminar = -4 * np.cos(4 * y) / (16 / 10.0 + 0.1)
    np.testing.assert_allclose(w, np.broadcast_to(laminar, w.shape), atol=1e-6)


@pytest.fixture(scope="module")
def turbulent():
    flow = KolmogorovFlow(grid=32, reynolds=100.0)
    return flow, trajectories(flow, 3, 7, snapshots=5, snapshot_dt=0.25, spinup=1.0)


def test_trajectories_are_deterministic_per_seed_and_per_initial_field(turbulent):
    flow, w = turbulent
    assert w.shape == (3, 5, 32, 32) and np.isfinite(w).all()
    again = trajectories(flow, 3, 7, snapshots=5, snapshot_dt=0.25, spinup=1.0)
    assert np.array_equal(w, again)
    other = trajectories(flow, 3, 8, snapshots=5, snapshot_dt=0.25, spinup=1.0)
    assert np.abs(other - w).max() > 0.5
    alone = flow.solve(w[1, 0], 5, 0.25)       # one trajectory solved on its own
    np.testing.assert_allclose(alone, w[1], atol=1e-10)


def test_a_trajectory_is_consecutive_in_time(turbulent):
    """Frame t + 1 is frame t advanced by snapshot_dt, and the flow changes between them."""
    flow, w = turbulent
    later = flow.solve(w[:, 2], 3, 0.25)
    np.testing.assert_allclose(later, w[:, 2:], atol=1e-10)
    change = np.linalg.norm(w[:, 1:] - w[:, :-1], axis=(-2, -1))
    assert (change > 0.05 * np.linalg.norm(w[:, :-1], axis=(-2, -1))).all()


# ---------------------------------------------------------------- the task


def kolmogorov(tmp_path, *overrides: str):
    cfg = load_config("examples/kolmogorov/config.yaml", [
        f"data.path={tmp_path / 'data'}", "model.grid=16", "model.modes=4",
        "model.trajectory_steps=5", "model.rollout_steps=3", "model.spinup=0.5",
        "model.files=2", "data.num_train=3", "data.num_test=2", *overrides])
    return build_task(cfg)


def is_store(path) -> bool:
    return path.name.startswith("part-")


def read(path, dataset: str) -> np.ndarray:
    store = Store(path, str(path))
    try:
        return np.asarray(store.get(dataset, "test")[...])
    finally:
        store.close()


def test_make_data_spreads_the_splits_over_atomic_member_files(tmp_path):
    task = kolmogorov(tmp_path)
    made = task.make_data()
    root = tmp_path / "data"
    assert "wrote 2 of 2 files" in made
    assert sorted(p.name for p in root.iterdir() if is_store(p)) == ["part-000.zarr",
                                                                     "part-001.zarr"]
    shapes = {(p.name, s): read(p, f"{s}/vorticity").shape
              for p in sorted(root.glob("part-*")) for s in ("train", "test")}
    assert shapes == {("part-000.zarr", "train"): (2, 5, 16, 16, 1),
                      ("part-000.zarr", "test"): (1, 5, 16, 16, 1),
                      ("part-001.zarr", "train"): (1, 5, 16, 16, 1),
                      ("part-001.zarr", "test"): (1, 5, 16, 16, 1)}
    train = task.train_source()
    assert train.count == 3 * 4                   # 4 one-step windows per trajectory
    assert task.eval_source().count == 2 * 2      # 2 windows of 3 rollout steps each
    # present: kept; a lost file is made again, identical (it depends on seed and file only)
    before = read(root / "part-001.zarr", "train/vorticity")
    assert "exists" in task.make_data()
    shutil.rmtree(root / "part-001.zarr")
    assert "wrote 1 of 2 files" in task.make_data()
    assert np.array_equal(read(root / "part-001.zarr", "train/vorticity"), before)


def test_make_data_writes_netcdf_and_hdf5_members(tmp_path):
    for source, name in (("netcdf", "part-000.nc"), ("hdf5", "part-000.h5")):
        task = kolmogorov(tmp_path / source, f"data.source={source}", "model.files=1")
        task.make_data()
        w = read(tmp_path / source / "data" / name, "test/vorticity")
        assert w.shape == (2, 5, 16, 16, 1) and w.dtype == np.float32


def test_other_data_files_in_data_path_are_refused_and_left_alone(tmp_path):
    task = kolmogorov(tmp_path)
    (tmp_path / "data").mkdir()
    stray = tmp_path / "data" / "old.h5"
    stray.write_bytes(b"keep me")
    with pytest.raises(ArrayDataError, match="old.h5"):
        task.make_data()
    assert stray.read_bytes() == b"keep me"
    assert not (tmp_path / "data" / "part-000.zarr").exists()


def test_the_window_is_required_and_named(tmp_path):
    task = kolmogorov(tmp_path, "data.window=null")
    with pytest.raises(ConfigError, match="data.window"):
        task.batch_fields()


def test_rollout_keys_sort_by_lead():
    assert [rollout_key(k, 8) for k in (1, 8)] == ["rollout_rel_l2_1", "rollout_rel_l2_8"]
    keys = [rollout_key(k, 12) for k in range(1, 13)]
    assert keys[0] == "rollout_rel_l2_01" and keys == sorted(keys)


def test_loss_and_metrics_feed_predictions_back(tmp_path):
    """A stand-in model that adds 1 to the newest frame: the rollout of k steps from input
    frames (a, b) is b + 1, b + 2, ...; a target equal to that has zero error."""
    task = kolmogorov(tmp_path, "data.window.input_steps=2", "data.window.target_steps=2")
    fields, evals = task.batch_fields(), task.eval_batch_fields()
    assert fields["input"].example_shape == (16, 16, 2)
    assert fields["target"].example_shape == (16, 16, 2)
    assert evals["target"].example_shape == (16, 16, 3)

    def model(x):
        assert x.shape[-1] == 2
        return x[..., -1:] + 1.0

    b = jnp.stack([jnp.full((4, 16, 16), v, jnp.float32) for v in (1.0, 2.0)], axis=-1)
    exact = jnp.stack([b[..., 1] + k for k in (1.0, 2.0, 3.0)], axis=-1)
    loss, _ = task.loss(model, {"input": b, "target": exact[..., :2]})
    assert float(loss) == 0.0
    off = exact.at[..., 1].add(1.0)                 # the second step is 1 off everywhere
    loss, _ = task.loss(model, {"input": b, "target": off[..., :2]})
    assert float(loss) == pytest.approx(0.5)
    metrics = task.eval_metrics(model, {"input": b, "target": off})
    assert set(metrics) == {"eval_loss", "test_rel_l2", "rollout_rel_l2_1",
                            "rollout_rel_l2_2", "rollout_rel_l2_3"}
    assert float(metrics["test_rel_l2"]) == float(metrics["rollout_rel_l2_1"]) == 0.0
    assert float(metrics["rollout_rel_l2_2"]) == pytest.approx(1 / 5)   # |1| / |5|
    sample = task.sample_outputs(model, {"input": b, "target": off})
    assert sample["lead_error"].shape == (4, 3)
    np.testing.assert_allclose(sample["prediction"], 5.0)
    np.testing.assert_allclose(sample["input"], 2.0)


def test_prepare_makes_missing_or_partial_data_but_leaves_a_users_own_files(tmp_path):
    task = kolmogorov(tmp_path)
    assert task.data_incomplete()                            # data.path missing
    (tmp_path / "data").mkdir()
    assert task.data_incomplete()                            # an empty directory
    task.prepare(is_coordinator=False)
    assert not any((tmp_path / "data").iterdir())            # only rank 0 makes it
    task.prepare(is_coordinator=True)
    assert not task.data_incomplete()
    shutil.rmtree(tmp_path / "data" / "part-000.zarr")
    assert task.data_incomplete()                            # an interrupted make
    own = kolmogorov(tmp_path, f"data.path={tmp_path / 'data' / 'part-001.zarr'}")
    assert not own.data_incomplete()                         # a store of the user's
    users = tmp_path / "users"
    users.mkdir()
    shutil.copytree(tmp_path / "data" / "part-001.zarr", users / "run-a.zarr")
    theirs = kolmogorov(tmp_path, f"data.path={users}")
    assert not theirs.data_incomplete()
    assert theirs.train_source().count == 1 * 4              # read as they are


def test_normalized_rollouts_work_in_model_units_and_report_physical_ones(tmp_path):
    """data.normalize: the model sees frames normalized with the train split's statistics
    (made with the data), is rolled out in those units, and metrics and predict are
    physical; the run keeps the statistics for use without the data."""
    task = kolmogorov(tmp_path, "data.normalize=true", f"run.dir={tmp_path / 'run'}",
                      "data.window.input_steps=2")
    task.prepare(True)                                  # the data, then their statistics
    assert (tmp_path / "data" / "stats.json").is_file()
    parts = sorted(p for p in (tmp_path / "data").iterdir() if is_store(p))
    w = np.concatenate([read(p, "train/vorticity") for p in parts]).astype(np.float64)
    mean, std = w.mean(), w.std()
    m, s = task.normalization()
    np.testing.assert_allclose(m, [mean], rtol=1e-5)
    np.testing.assert_allclose(s, [std], rtol=1e-5)

    seen = []

    def model(x):
        seen.append(np.asarray(x))
        return x[..., -1:] * 0.5

    frames = w[:, :, :, :, 0].transpose(0, 2, 3, 1).astype(np.float32)   # (traj, x, y, t)
    batch = {"input": jnp.asarray(frames[..., 0:2]), "target": jnp.asarray(frames[..., 2:5])}
    z = [(frames[..., 1:2] - mean) / std * 0.5 ** k for k in (1, 2, 3)]    # model units
    physical = [zk * std + mean for zk in z]
    np.testing.assert_allclose(np.asarray(task.predict(model, batch)), physical[0],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(seen[-1], (frames[..., 0:2] - mean) / std, rtol=1e-4,
                               atol=1e-5)
    metrics = task.eval_metrics(model, batch)
    truth = [frames[..., k:k + 1] for k in (2, 3, 4)]
    np.testing.assert_allclose(float(metrics["eval_loss"]),
                               np.mean((z[0] - (truth[0] - mean) / std) ** 2), rtol=1e-4)
    for k in range(3):
        rel = np.mean(np.sqrt(((physical[k] - truth[k]) ** 2).sum((1, 2, 3))
                              / (truth[k] ** 2).sum((1, 2, 3))))
        np.testing.assert_allclose(float(metrics[f"rollout_rel_l2_{k + 1}"]), rel, rtol=1e-4)

    shutil.rmtree(tmp_path / "data")                    # the run, elsewhere: no data
    again = kolmogorov(tmp_path, "data.normalize=true", f"run.dir={tmp_path / 'run'}",
                       "data.window.input_steps=2").normalization()
    np.testing.assert_array_equal(again[0], m)
    np.testing.assert_array_equal(again[1], s)


def test_the_rollout_plot_draws_the_last_evaluation_over_every_test_window(tmp_path):
    from spmd.tasks.figures import last_rollout_errors, plot_rollout_error

    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "loss": 1.0},
             {"step": 0, **{f"rollout_rel_l2_{k}": 1.0 for k in (1, 2, 3)}},
             {"step": 50, **{f"rollout_rel_l2_{k}": 0.1 * k for k in (1, 2, 3)}}]
    metrics.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 60, "rollo')
    keys = [rollout_key(k, 3) for k in (1, 2, 3)]
    step, errors = last_rollout_errors(metrics, keys)
    assert step == 50
    np.testing.assert_allclose(errors, [0.1, 0.2, 0.3])
    assert last_rollout_errors(metrics, [*keys, "rollout_rel_l2_4"]) is None  # 4 leads
    assert last_rollout_errors(tmp_path / "missing.jsonl", keys) is None
    png = plot_rollout_error(np.full((2, 3), 0.5), tmp_path / "r.png", 0.25, (step, errors))
    assert png.stat().st_size > 10_000
