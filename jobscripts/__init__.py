"""Batch-script templates (Jinja2), one per scheduler; rendered by `spmd jobscript`.

Owns the template files only (`*.sh.j2`, read as package data by `spmd.hpc.batch_scripts`);
it holds no Python code and imports nothing.
"""
