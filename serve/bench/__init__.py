"""Benchmarks: `draftsmith bench` (the methods matrix, its chart, model shapes) and `bench-serve`."""
