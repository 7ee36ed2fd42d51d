"""dsgpt2: pretrain GPT-2 with DeepSpeed on a corpus stored in MongoDB."""

__version__ = "0.1.0"
