"""What the toolkit knows about SLURM, one module per subject: its commands (``commands``), batch
script directives (``directives``), time limits (``time_limit``) and partitions (``partitions``).
The backends that submit through SLURM (``orchestrator.backends.slurm``, ``submitit_slurm``) and
the launch checks read SLURM only through these modules."""
