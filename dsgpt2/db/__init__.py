"""The database layer: connection config, the per-process client and its retries, the FILTER checks,
meta_info, the unified index over the collections (``MongoWrapper``), idx edges and batched inserts, the
embedded server of ``local://`` and the index checks. The only room that imports pymongo."""
