"""Bounds and defaults that the client, the daemon and the cluster endpoint share, kept in one place."""

MAX_WEIGHT = 1e6  # a session's fair-share weight (hello.weight, a lend's weight) is in (0, MAX_WEIGHT]
MAX_DEADLINE_MS = 3_600_000.0  # an hour: the most a suspend deadline, a request's timeout or an SLO may be
DEFAULT_SUSPEND_DEADLINE_MS = 5000.0  # how long a suspended session gets to park its state, unless told
MAX_NAME_CHARS = 128  # a session's name, a borrower's (hello.name, hello.borrower, lend.borrower, renew.borrower)
MAX_TENSORS = 64  # tensors in one infer's inputs or one registration's example_input
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a registered model's name
