"""Environments of multi-turn episodes: the protocol (base.py), the built-in ones over any text task
(builtin.py: retry, python_tool) and the sandbox that runs tool code (sandbox.py). Not yet driven by the
rollout ranks (issue 30)."""
