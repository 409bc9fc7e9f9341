"""Tests of ctxpool/: warm worker contexts, the engine and the model store."""
