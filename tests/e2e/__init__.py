"""Tests of end to end: the README, the examples, systemd, several nodes."""
