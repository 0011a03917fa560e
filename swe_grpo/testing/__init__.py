"""Helpers shared by the tests, the benchmarks and the demo; never imported by the data path."""
