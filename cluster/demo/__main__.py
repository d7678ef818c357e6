"""`python -m cluster.demo`: the `make run` demo."""
import sys

from cluster.demo.run import main

sys.exit(main())
