"""One rollout instance: the built-in paged-KV engine (default) and the vLLM backend (engine.backend).

Importing this package pulls in torch; nothing in core/ or sim/ imports it.
"""
