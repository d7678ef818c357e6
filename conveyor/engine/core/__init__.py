"""The engine core: EngineCore (engine_core.py), the Scheduler and what it
schedules (request.py, request_queue.py, async_scheduling.py, stopping.py),
the busy loop that steps it, worker-group recovery, and InProcCoreClient (the
core in a thread of this process). Pure Python + numpy up to the executor:
`import conveyor.engine.core.scheduler` loads no torch."""
