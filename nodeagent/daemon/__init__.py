"""The daemon's core: the event loop, the local endpoint, and the components
the loop hands events to (see docs/architecture.md for the map)."""
