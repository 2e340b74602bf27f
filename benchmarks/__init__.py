"""Benchmarks: eager vs Inductor vs pypto, side by side in one process."""
