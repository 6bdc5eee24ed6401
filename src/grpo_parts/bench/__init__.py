"""Benchmarks (not tests): each module compares optimized and reference parts side by side."""
