"""A worker's HTTP server: the OpenAI handlers on the engine, hand-off endpoints, metrics."""
