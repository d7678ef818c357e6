"""`python -m cluster.demo_model DIR` (a public path): builds the demo
checkpoint at DIR; the code is cluster/demo/model.py."""
from cluster.demo.model import ensure_demo_model, main

__all__ = ["ensure_demo_model", "main"]

if __name__ == "__main__":
    main()
