"""The recipes the toolkit ships, as package data: ready-to-run ``.sub`` and YAML recipes, the
Hydra configs of ``python -m train`` (``recipes.conf``, launcher presets included), the W&B
dashboard spec and the demo job (``python -m recipes.smoke``)."""
