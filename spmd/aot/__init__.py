"""Ahead-of-time tools: compile a run for devices you do not have, and read its plan.

Owns: `spmd plan` (`plan`: memory, FLOPs, fits or not), N CPU devices standing in for N
accelerators (`stand_ins`) and the GPU topologies the plan compiles for (`topologies`).
May import the engine, `spmd.hpc` (system profiles) and everything below them.
"""
