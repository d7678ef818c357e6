"""The OpenAI-compatible HTTP API: app.py (routes, middleware order), server.py
(validate -> admit -> run), protocol.py (request/response models),
responses.py (bodies and SSE chunks), tools/, responses_api/ (/v1/responses),
routes/ (admin, LoRA, utility endpoints)."""
