"""ResumeLedger lives in engine/resume_ledger.py (the data-parallel client
migrates with it too); this name stays for existing imports."""
from engine.resume_ledger import ResumeLedger

__all__ = ["ResumeLedger"]
