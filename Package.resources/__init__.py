"""Data shipped with ondevice (model catalog, default draft weights, icons)."""
