"""The input formats ingest reads, named once: the command line's choices, the readers' dispatch and the
columnar reader's own set all come from here (a light module: the CLI imports it to build its parser)."""

from __future__ import annotations

TEXT = ("text", "jsonl", "csv", "conversation")  # read as text, line by line (dsgpt2.corpus.readers)
COLUMNAR = ("parquet", "arrow", "dataset")  # read in record batches (dsgpt2.corpus.columnar)
FORMATS = ("auto", *TEXT, *COLUMNAR)  # "auto": told by the file's suffix and first bytes
