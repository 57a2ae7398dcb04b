"""Checkpoints that chain across jobs: DCP for the sharded state, written atomically.

One module a job; import a name from the module that owns it:

- ``manager``: ``CheckpointManager`` (save, load, prune; the layout on disk and why a
  ``step_<N>`` directory is always whole) and its errors;
- ``collectives``: how the ranks agree (without a process group: one rank);
- ``hyperparameters``: the optimizer's hyperparameters saved once, not per parameter;
- ``references``: the frozen pretrained parts a checkpoint holds by reference, and their digests;
- ``rng``: each rank's generator states, in a file of its own;
- ``nonfinite``: the scan that keeps NaN and inf out of a checkpoint;
- ``staging``: the reused CPU copy that an asynchronous save writes;
- ``disk``: durable writes, and the one line a failed write or a full disk gets;
- ``pauses_for_tests``: the hook by which tests tear a real save at a known moment.
"""
