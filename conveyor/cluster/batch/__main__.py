"""`python -m conveyor.cluster.batch`: runs conveyor.cluster.batch.job under its real module name,
so Ray pickles the job's classes by reference."""
import sys

from conveyor.cluster.batch.job import main

sys.exit(main())
