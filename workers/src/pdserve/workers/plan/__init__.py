"""Planning a pool before buying it: `pdserve profile` measures a model's step cost and
hand-off time on this machine; the simulator runs the engine's own scheduler and token
budget, the router's bucket and load policy and the hand-off over a trace, on a
simulated clock whose steps take the profiled time; `pdserve simulate` answers the
operator's `pdserve plan` with the figures `pdserve bench` would report."""
