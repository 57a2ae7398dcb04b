"""The shared training entrypoint: config, mesh, model, parallelize, data, checkpoint, metrics."""
