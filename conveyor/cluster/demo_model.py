"""`python -m conveyor.cluster.demo_model DIR` (a public path): builds the demo
checkpoint at DIR; the code is conveyor/cluster/demo/model.py."""
from conveyor.cluster.demo.model import ensure_demo_model, main

__all__ = ["ensure_demo_model", "main"]

if __name__ == "__main__":
    main()
