"""Trained weights on disk, below both training and inference: the checkpoint format and the weights of
an export or a checkpoint. Nothing here builds an engine or a data pipeline."""
