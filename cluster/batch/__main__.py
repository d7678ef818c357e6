"""`python -m cluster.batch`: runs cluster.batch.job under its real module name,
so Ray pickles the job's classes by reference."""
import sys

from cluster.batch.job import main

sys.exit(main())
