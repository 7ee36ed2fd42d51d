"""The training run: flags, DeepSpeed config, checkpoints, weights, metrics, memory plan.

Only this package imports deepspeed, each time after :func:`dsgpt2.accelerator.prepare_deepspeed_environment`.
"""
