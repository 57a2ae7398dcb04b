"""Models trained by the shared entrypoint, each with its parallelize plan beside it."""
