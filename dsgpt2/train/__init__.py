"""The training run: flags, DeepSpeed config, checkpoints, weights, metrics, memory plan."""
