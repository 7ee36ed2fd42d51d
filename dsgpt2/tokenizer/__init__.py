"""The vocabulary: texts for it (shards or a stream from MongoDB) and the byte-level BPE."""
