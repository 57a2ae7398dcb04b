"""What the training loop is made of, besides the model, the data and the checkpoint.

- ``step``, ``step_tallies``, ``step_log``: one optimizer step's forward and backward, its
  figures kept on the device, and when they are read back and logged;
- ``train_state``: what the training has done so far, saved in every checkpoint;
- ``stop``: a signal, a time limit or a budget ending training at a step;
- ``watchdog``, ``host_syncs``, ``device_trap``: guards against a hung rank, a host sync in the
  step and a tensor made without a device;
- ``garbage``: Python's cycle collector, run at the loop's steps;
- ``faults``: the faults a test asks for.
"""
