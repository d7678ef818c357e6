"""The cluster layer: everything that knows about Ray, Serve and HTTP, around
the engine (the import arrow runs conveyor/cluster/ -> conveyor/engine/, never back).

    openai/        the OpenAI-compatible HTTP API: routes, handlers, models, bodies, tools
    engine_actor/  the engine core in a Ray actor: the actor, its link, its client
    serve_app.py   the Ray Serve deployment (`conveyor.cluster.serve_app:build_app`)
    batch/         offline JSONL jobs (`python -m conveyor.cluster.batch`)
    cli/           the `conveyor` command and its config-override flags
    demo/          the `make run` demo and its checkpoint (`python -m conveyor.cluster.demo_model DIR`)
"""
