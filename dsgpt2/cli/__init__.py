"""The ``dsgpt2`` command: the root parser (``main``), one module per stage with its subcommands' parsers
and ``cmd_*`` functions, and the in-process pipeline of ``dsgpt2 demo``."""
