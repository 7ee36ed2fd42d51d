"""Documents into the database: the readers and exactly-once ingest, cleaning, the built-in sample,
numbering collections in place, the high-water marks of a growing corpus and seeded per-document draws."""
