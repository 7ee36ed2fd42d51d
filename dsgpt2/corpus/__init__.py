"""The corpus in MongoDB: connection config, client and retries, documents, ingest, validate."""
