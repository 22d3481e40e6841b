"""Mesh sizes from config, the -1 absorber, and the hybrid (inter/intra-node) layout."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spmd.config.schema import MeshConfig
from spmd.engine.mesh import build_mesh, hybrid_layout, mesh_axis_sizes
from spmd.errors import ConfigError


def test_preset_defaults_and_absorber():
    assert mesh_axis_sizes(MeshConfig(strategy="fsdp_tp"), 8)["fsdp"] == 4
    sizes = mesh_axis_sizes(MeshConfig(strategy="fsdp", axes={"data": 2}), 8)
    assert sizes["data"] == 2 and sizes["fsdp"] == 4
    # an explicit absorber replaces the preset's
    sizes = mesh_axis_sizes(MeshConfig(strategy="fsdp", axes={"data": -1, "fsdp": 2}), 8)
    assert sizes["data"] == 4 and sizes["fsdp"] == 2


@pytest.mark.parametrize("axes, needle", [
    ({"tensor": 3}, "does not divide the 8 devices"),
    ({"data": 2, "fsdp": 2, "tensor": 1}, "multiply to 4 but there are 8 devices"),
    ({"data": -1, "tensor": -1}, "only one axis may be -1"),
    ({"tensr": 2}, "mesh.axes.tensr: not a mesh axis"),
    ({"data": 0}, "must be positive or -1"),
])
def test_bad_sizes_name_the_key(axes, needle):
    with pytest.raises(ConfigError, match=needle):
        mesh_axis_sizes(MeshConfig(strategy="dp", axes=axes), 8)


def test_inter_node_factors_go_on_outer_axes():
    sizes = {"data": 2, "stage": 1, "fsdp": 4, "context": 1, "tensor": 2, "expert": 1}
    layout = hybrid_layout(sizes, 4)
    assert layout.inter_node["data"] == 2 and layout.inter_node["fsdp"] == 2
    assert layout.inter_node["tensor"] == 1 and layout.intra_node["tensor"] == 2
    with pytest.raises(ConfigError, match="cannot be laid out over 3 nodes"):
        hybrid_layout(sizes, 3)


def test_devices_of_one_node_stay_together_on_inner_axes():
    # 8 devices as 4 "nodes" of 2 (process_index is 0 for all here, so group by node list)
    devices = jax.devices()
    mesh = build_mesh(MeshConfig(strategy="fsdp_tp"), devices)  # fsdp=4 x tensor=2
    grid = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
    # tensor (innermost) pairs are neighbours
    assert all(abs(a - b) == 1 for a, b in grid)
