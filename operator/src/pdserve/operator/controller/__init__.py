"""The kopf controller: handlers, reconciliation, status, the resync loop, drift and the
Kubernetes client."""
