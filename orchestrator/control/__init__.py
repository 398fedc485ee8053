"""The driver side of a job: probe, plan and place it, follow its ranks, recover, and record the run."""
