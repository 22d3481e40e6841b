"""A vision transformer learning the 2-D Poisson solution operator (see task.py)."""
