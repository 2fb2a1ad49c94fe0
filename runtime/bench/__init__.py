"""Benchmarks: ``python -m runtime.bench ...`` (results written to a JSON file)."""
