"""Tests of the tree itself: names, docstrings, the suite's own machinery."""
