"""Benchmarks that print figures (not timed tests), and the GPU check.

Run from the repository root as modules, ``python -m bench.NAME`` (``bash bench/gpu_check.sh``
for the GPU check), so that the checkout's packages and this one import without touching
``sys.path``. Three borrow the test harness (its charter says which and why); the rest use the
toolkit as a user does.
"""
