"""Training data: split and dealing, packing, conversations, chunk sources, the loader."""
