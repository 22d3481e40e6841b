"""Reference models, written with logical axis names only.

Owns the built-in transformer, MLP and FNO and their layers. May import `spmd.sharding`
(`with_axes`, `constrain`) and nothing else of spmd: no model file names a mesh axis.
"""
