"""What the benchmark scripts share, one copy each (see bench/__init__.py).

Imports nothing at package level: bench.lib.proc_tree and bench.lib.prompts
must load under the peers' Pythons too (stdlib and numpy only).
"""
