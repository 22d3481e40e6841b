raise ImportError("the user project's own models/ was imported by spmd")
