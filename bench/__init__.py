"""Benchmarks of the product: python -m bench.<name> from the repository root (see docs/performance.md)."""
