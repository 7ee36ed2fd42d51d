"""The ``dsgpt2`` subcommands, one module per stage: each adds its parsers and runs its commands."""
