"""Reference models, written with logical axis names only."""
