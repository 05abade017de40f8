"""One module per CLI verb; each exposes ``register(app)``. Parsing and rendering only."""
