"""The OpenAI-compatible server: `engine` (continuous batching), `requests` / `protocol` (what a request
asks for), `answer` / `runs` (text as it settles), `responses` and `app` (HTTP)."""
