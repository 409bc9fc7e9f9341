"""Tests of sharing/: the pure schedulers and policies."""
