"""Frontends: LLM (offline, blocking) and AsyncLLM (serving, batch), what
they do to a request before the core sees it (prepare.py: tokenize, limits,
`n` fan-out) and after (output_processor.py, detokenizer.py), and the
checks at the edge (json_limits.py, checkpoint_check.py)."""
