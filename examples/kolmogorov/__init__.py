"""An FNO surrogate of 2-D Kolmogorov flow, rolled out autoregressively (see task.py)."""
