"""The facts that the trainer and the orchestrator both use, with one owner each.

Standard library only, and importing nothing of the project: ``train`` imports from here and
never from ``orchestrator`` or ``hydra_plugins``; ``orchestrator`` imports from here and from
``train``; ``hydra_plugins`` from all three. docs/contracts.md says which module owns which name.

- ``contract.job_env``: the ``ORCH_*`` variables a job gets, the seed range, the rendezvous port.
- ``contract.run_dir``: the run dir's layout, its complete checkpoints and the disk's room.
- ``contract.job_end``: the trainer's exit codes, its end-of-job record, the log's outcome line.
- ``contract.slurm_states``: which SLURM job states mean the job has ended.
- ``contract.credentials``: the one rule for names that look like they hold a credential.
- ``contract.spelling``: the one rule for the name a misspelt one probably meant.
- ``contract.gpus``: the GPU table (the planner prices layouts with it, the trainer's MFU too).
- ``contract.configs``: where the packaged Hydra configs live and the entrypoints' names.
"""
