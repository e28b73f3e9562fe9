"""The OpenAI-compatible front door that routes requests to workers."""
