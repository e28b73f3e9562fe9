"""The inference engine: model, paged KV cache, scheduler, runner and step loop."""
