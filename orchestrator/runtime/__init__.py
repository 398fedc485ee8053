"""What runs inside each worker: the actor, the process group, parallelism (DDP, FSDP2, TP,
pipelines), the training loop, checkpoints, NCCL settings and metrics."""
