"""SLO-driven scaling: the planner, its signals (PromQL, the Prometheus client), one
scaling round, the autoscaler loop, HPA/KEDA rendering and the disaggregation condition."""
