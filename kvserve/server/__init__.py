"""The OpenAI-compatible HTTP server: ``build_app(AsyncEngine, ...)``; ``kvserve serve`` runs it."""
