"""dsgpt2 benchmarks: every figure is a ratio against an anchor measured in the same run."""
