raise ImportError("the user project's own launch/ was imported by spmd")
