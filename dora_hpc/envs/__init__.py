"""Environments of multi-turn episodes (issue 30, in progress): so far the sandbox that runs tool code."""
