"""Curating the corpus in place: one protocol of a step (:mod:`dsgpt2.curation.steps`), the driver of a
pass over idx ranges, exact and near duplicates, quality signals, decontamination, languages, PII, and the
report of what every step marked.

The built-in steps are registered here, in the order the commands run them, ``dsgpt2 ingest`` lists its
switches and ``dsgpt2 curate report`` lists what they leave out.
"""

# isort: off
from dsgpt2.curation import dedup  # noqa: F401  exact, then near duplicates; duplicates at ingest
from dsgpt2.curation import curate  # noqa: F401  quality verdicts
from dsgpt2.curation import decontaminate  # noqa: F401
from dsgpt2.curation import language  # noqa: F401
from dsgpt2.curation import pii  # noqa: F401  redaction, in place and at ingest
# isort: on
