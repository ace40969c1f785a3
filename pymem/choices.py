"""The accepted values of pymem's settings, torch-free: the startup hook checks the ``PYMEM_*``
variables against them before the program imports torch (``pymem._startup``), and ``pymem.enable``
checks its arguments against the same tuples (``pymem.runtime.settings``)."""

ALLOCATORS = ("arena", "native")
COSTS = ("measured", "estimate")
PLANS = ("auto", "off")  # plan each step from the last (policies/planned.py), or not
INTERCEPTS = ("mode", "dispatcher")  # runtime/interception.py
# The registered names of pymem.policies (a test holds them equal): importing the policies to list
# them would be most of what the startup hook costs a process that never uses them.
POLICIES = ("coop", "dtr", "dtr-chain", "dtr-local", "lru", "msps", "size")
DIRECTORS = ("always", "capuchin", "delta", "never")
