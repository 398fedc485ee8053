"""Driver, worker actor, trainer, strategies, checkpoints: everything that runs the job."""
