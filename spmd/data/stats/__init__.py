"""Statistics: per-channel moments for normalized training (`normalization`) and the fingerprint
of the data a run trains on (`run_inputs`).
"""
