"""pdserve: LLM serving with prefill/decode disaggregation and chunked prefill."""

__version__ = "0.1.0"
