"""OpenAI-compatible HTTP server: FastAPI routes over an engine driven by one background thread."""
