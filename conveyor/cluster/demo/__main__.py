"""`python -m conveyor.cluster.demo`: the `make run` demo."""
import sys

from conveyor.cluster.demo.run import main

sys.exit(main())
