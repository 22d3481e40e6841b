"""A 3-D U-Net learning one diffusion step of volumetric fields (see task.py)."""
