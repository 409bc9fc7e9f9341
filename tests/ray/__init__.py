"""Tests of nodeagent_ray/: placement and elastic training on Ray."""
