"""How the weights move: the optimizers (a registry of them, each owning its options, its resume rule and
the names of its state), the learning-rate schedules, and the DeepSpeed config they are written into.

DeepSpeed's own optimizers are imported here (Muon's), after
:func:`dsgpt2.accelerator.prepare_deepspeed_environment`.
"""
