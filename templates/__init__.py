"""The Jinja2 batch-script templates (``*.sub.j2``) that YAML recipes render through.

A package only so that the templates install with the toolkit and are found from any directory
(``orchestrator.resources.packaged_templates``); it holds no code.
"""
