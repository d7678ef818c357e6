"""The router benchmarks: routing.py (the real Router in front of simulated
engines: hit rate, balance, decision latency), routing_live.py (live servers,
ours per policy and Ray Serve LLM, on a multi-turn chat workload), with the
simulation (routing_sim.py) and its workloads (routing_workloads.py).
"""
