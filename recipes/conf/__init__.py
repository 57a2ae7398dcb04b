"""Hydra configs of ``python -m train``; Hydra reads them as ``pkg://recipes.conf``."""
