"""The test harness: everything the test modules share, and nothing else.

Test modules and ``tests/conftest.py`` (which holds fixtures and hooks only) import shared code
only from here, never from each other or from the conftest, so that a test module can change
without breaking another; the harness imports no test module (tests/test_contract.py checks
both). Three benchmarks borrow it too, as the only code outside tests/ that may:
bench/bench_recovery.py (a training rank to kill), bench/bench_remote_launch.py (the SSH login
node) and bench/gpu_flows.py (the conversation mixture); a change here must keep them running.
Its modules, none importing a later one of this list:

- ``graphs``, ``readme``: circles in a directed graph; the commands README shows
- ``process``: the repository, its tools and modules run as a user runs them (Python's ranks
  forked from a zygote that imported the trainer once); a missing capability
- ``wheel``: the project's wheel, built as a user's pip builds it
- ``login_node``: an SSH login node on loopback where a second Unix user runs the toolkit
- ``cluster``: the loopback SLURM cluster's handle, command line and queue; SLURM's commands
  run through wrappers that count their calls
- ``chains``: chains launched as a user launches them, and the waits for their jobs
- ``exit_codes``: the docs' one table of exit codes, a SLURM that refuses every job, Ctrl-C
- ``recorded_jobs``: recipes whose jobs record what they saw, and the checks of the records
- ``disk``: small real file systems to fill up
- ``training``: the trainer run on the test corpus, and its metrics rows and weights
- ``models``: converted real models, and a trained run as a model, exported and evaluated
- ``results``: results in the documented formats, in registered chains; status read back
- ``wandb_runs``: W&B offline runs read back by wandb's own reader
- ``corpora``: the sizes of the corpora the session's fixtures make
- ``hf_tiny``, ``synthetic``, ``planner_cases``: tiny Hugging Face models, a synthetic batch,
  the planner's measured layouts
- ``workers/``: the scripts tests start as processes (plain, or ranks), and the rank zygote
"""
