"""A private SLURM cluster on loopback: one slurmctld and N slurmd daemons on this machine, and
with ``--accounting`` a slurmdbd backed by a private MariaDB server.

Everything the cluster owns lives under one directory (its slurm.conf, slurmdbd.conf, state,
spool, database, logs, pid files and ``cluster.json``), so a test cluster and a user's demo
cluster can run side by side on different ports.

One job a module: ``record`` (``cluster.json`` and the directory's layout), ``config`` (slurm.conf
and slurmdbd.conf), ``daemons`` (which processes are the cluster's, and starting them),
``munge``, ``queries`` (node states and the queue), ``lifecycle`` (up, repair, down),
``status`` (``cluster status`` and ``cluster env``) and ``cli`` (the ``orchestrator cluster``
subcommand).
"""
