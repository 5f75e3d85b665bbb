"""A module that registers no step: `serve --steps` refuses it."""
X = 1
