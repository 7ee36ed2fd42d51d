"""The database layer: connection config, the per-process client and its retries, meta_info, the unified
index over the collections (``MongoWrapper``), the embedded server of ``local://`` and the index checks.
The only room that imports pymongo."""
