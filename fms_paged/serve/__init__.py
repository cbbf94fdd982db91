"""`fms-paged serve`: an OpenAI-compatible HTTP server on the continuous-batching engine (FastAPI +
uvicorn, the `serve` extra). `loop` runs the engine in a thread of its own; `app` is the HTTP front
end; `requests` / `responses` translate between OpenAI bodies and engine requests."""
