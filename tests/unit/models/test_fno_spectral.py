"""The FNO's spectral convolution, written as contractions with truncated DFT matrices, is the
paper's layer: irfft2 of the lowest modes of rfft2, mixed by the complex weights. Checked
against numpy's FFTs in float64, on a square grid and on one whose kept y modes reach the
Nyquist frequency (weighted 1, like ky = 0, in the inverse real transform)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from spmd.models.fno import SpectralConv2d


def numpy_spectral_conv(h: np.ndarray, w: np.ndarray, modes: int) -> np.ndarray:
    """h: (batch, gx, gy, in) real; w: (2 corners, in, out, modes, modes) complex."""
    _, gx, gy, _ = h.shape
    spectrum = np.fft.rfft2(h.astype(np.float64), axes=(1, 2))
    mixed = np.zeros(spectrum.shape[:3] + (w.shape[2],), np.complex128)
    low, high = slice(0, modes), slice(gx - modes, gx)
    mixed[:, low, :modes] = np.einsum("bxyi,ioxy->bxyo", spectrum[:, low, :modes], w[0])
    mixed[:, high, :modes] = np.einsum("bxyi,ioxy->bxyo", spectrum[:, high, :modes], w[1])
    return np.fft.irfft2(mixed, s=(gx, gy), axes=(1, 2))


@pytest.mark.parametrize("grid, modes", [((16, 16), 4), ((12, 8), 5)],
                         ids=["square", "nyquist-kept"])
def test_spectral_conv_is_irfft2_of_the_mixed_lowest_modes(grid, modes):
    layer = SpectralConv2d(3, 5, modes, rngs=nnx.Rngs(0))
    h = np.random.default_rng(1).standard_normal((2, *grid, 3)).astype(np.float32)
    w = (np.asarray(layer.weight_real[...], np.float64)
         + 1j * np.asarray(layer.weight_imag[...], np.float64))
    got = np.asarray(jax.jit(layer)(h), np.float64)
    want = numpy_spectral_conv(h, w, modes)
    assert got.shape == want.shape == (2, *grid, 5)
    scale = np.abs(want).max()
    assert scale > 0
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
