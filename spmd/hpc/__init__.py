"""HPC systems: machine profiles and the batch scripts rendered for them.

Owns: system profiles (scheduler, GPUs, launcher line, environment: `systems`) and job-script
rendering, submission and chaining (`batch_scripts`, templates in `spmd.jobscripts`). May
import `spmd.config`, `spmd.launch` and `spmd.errors`; it builds no model and runs no step.
"""
