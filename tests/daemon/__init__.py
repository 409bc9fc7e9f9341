"""Tests of nodeagent/ and nodeagent/daemon/: the daemon, its components, CLI and settings."""
