"""One rollout instance: the built-in paged-KV engine (default) and, later, a vLLM backend.

Importing this package pulls in torch; nothing in core/ or sim/ imports it.
"""
