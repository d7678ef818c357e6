"""The `make run` demo: run.py (serve the demo model, answer one request),
model.py (the demo checkpoint), train.py (how assets/ was trained)."""
