"""`pdserve plan`: which pool meets a ServingPool's SLO on a trace with the fewest
workers. Candidate pools (colocated with token budgets, bucketed with boundaries,
disaggregated with prefill:decode splits, counts within the pool's bounds) are
rendered as the operator renders pools and simulated by the workers' simulator
(`pdserve simulate`, on a `pdserve profile` file); the answer is a ServingPool."""
