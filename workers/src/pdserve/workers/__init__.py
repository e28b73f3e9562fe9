"""pdserve data plane: the engine, workers, KV transfer and the load generator."""
