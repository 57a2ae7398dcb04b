"""Hydra launchers for sweeps on SLURM: chained members (``chain_slurm``, ``chain_local``) and
submitit members with a run dir and seed each (``orch_submitit_slurm``, ``orch_submitit_local``).

Hydra imports every module under ``hydra_plugins`` to discover plugins, so these modules import
torch, submitit and the trainer only inside the functions that need them.
"""
