"""The P/D hand-off between a decode worker and a prefill worker (see docs/architecture.md):
the wire format, the prefill side's endpoints, and the decode side's driver."""
