"""Where checkpoints and tokenizers are kept: a directory, or a kind of location registered in ``STORES``
by its scheme (:mod:`dsgpt2.stores.base`).

The built-in kinds are registered here, as the package is imported.
"""

from dsgpt2.stores import gridfs  # noqa: F401  gridfs:NAME, in the corpus's database
