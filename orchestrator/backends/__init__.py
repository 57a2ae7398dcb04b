"""Backends: slurm (sbatch and friends), submitit (SlurmExecutor/LocalExecutor), local."""
