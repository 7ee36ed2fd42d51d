"""Trained weights, below both training and inference: the checkpoint format, this machine's copy of a
run kept elsewhere (:mod:`dsgpt2.stores`), and the weights of an export or a checkpoint. Nothing here
builds an engine or a data pipeline."""
