"""kvpath.proxy: the OpenAI-compatible P/D proxy and the path reservation service (FastAPI)."""
