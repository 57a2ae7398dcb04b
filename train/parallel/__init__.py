"""The parallel layout of a job, from arithmetic checked before any process group to the mesh.

- ``dims``, ``pipeline_plan``, ``layout``: the layout as plain arithmetic, its checks and the
  pipeline's schedule and stage split;
- ``launch_env``, ``distributed``, ``mesh``: the process group, the collectives the loop needs
  beside the model's own, and the DeviceMesh views.

How a model is sharded over the mesh lives beside each model (train/models/parallelize.py).
"""
