"""Curating the corpus in place: passes over idx ranges, exact and near duplicates, quality signals, and
the report of what every pass marked."""
