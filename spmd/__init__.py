"""spmd: train large scientific models with JAX on HPC supercomputers."""

__version__ = "0.1.0"
