"""Batch-script templates (Jinja2), one per scheduler; rendered by `spmd jobscript`."""
