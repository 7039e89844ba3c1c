"""Mesh axis names used across the project. Import these; never scatter bare strings."""

DATA = "data"
EXPERT = "expert"
TENSOR = "tensor"
