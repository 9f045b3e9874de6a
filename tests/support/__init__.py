"""What several test files share: stand-in engines (`support.engines`) and the statistics of the
distribution tests (`support.stats`). `conftest.py` puts `tests/` on the import path, so test
files import them as `support.engines` and `support.stats`."""
