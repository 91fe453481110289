"""Pure decision logic (no torch, MPI, files or clocks): events in, commands out.

Drivers (runtime, simulator, tests) feed ``policy.on(event)`` and execute the commands it returns.
"""

from .events import *  # noqa: F403
from .policies import MODES, Policy, PolicyConfig, make_policy, policy_for  # noqa: F401
