"""Tests of bench/ and scripts/gpu-check.sh: the benchmarks and their reports."""
