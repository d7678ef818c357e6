"""Tool calling: the request side (request.py: tools and tool_choice into a
plan and a constraint), the response side (response.py: parsed calls and
stream deltas) and the per-model parsers (parsers/)."""
