"""Data parallel: N engine cores behind one frontend.

DataParallelClient (client.py) is a CoreClient; the router (router/) picks
an engine per request; the mover (mover.py) moves requests between engines
when one is drained or lost; scaling.py adds, removes and rolls out engines;
the autoscaler's policy is scale_policy.py. See ARCHITECTURE.md, "How a
request moves between engines"."""
