"""Training: the update step (torch / DeepSpeed backends), the critic, exact checkpoints, the warm start."""
