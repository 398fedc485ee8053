"""The run record: what a job leaves in its run directory and shows while it runs (progress,
summary, report, loss curve, Grafana, worker logs), written from what the driver saw; it makes
no decision about the run."""
