"""Offline batch jobs: job.py (the JSONL driver and its CLI), engines.py (the
engines a job runs on). Run with `python -m conveyor.cluster.batch`."""
