"""Tests of client_lib/: the client library, its protocol and framework integrations."""
