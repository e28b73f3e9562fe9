"""Put on a worker's PYTHONPATH, this turns on its engine's per-step DEBUG logs (the
chunks each step ran and what it took, `support.step_log`) and nothing else: the
worker's other loggers keep its `--log-level`, so the logs add two lines a step."""

import logging

for name in ("pdserve.workers.engine.steps", "pdserve.workers.engine.step_timing"):
    logging.getLogger(name).setLevel(logging.DEBUG)
