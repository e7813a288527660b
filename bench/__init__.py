"""Benchmarks and the load-test harness. Each benchmark prints one JSON object."""
