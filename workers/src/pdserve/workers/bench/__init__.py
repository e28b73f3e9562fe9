"""The load generator behind `pdserve bench`.

Programmatic use (what tests and `pdserve demo` call)::

    from pdserve.workers.bench.config import BenchConfig
    from pdserve.workers.bench.metrics import SLO
    from pdserve.workers.bench.report import format_report, write_json, write_plot
    from pdserve.workers.bench.runner import run_benchmark  # arun_benchmark in a loop

    result = run_benchmark(BenchConfig(url, workload="mixed", duration_s=60,
                                       slo=SLO(ttft_ms=500, itl_ms=100)))
    print(format_report(result))

Modules: `workloads` (length distributions), `arrivals` (Poisson and gamma),
`trace` (Azure CSV replay), `plan` (what is sent when), `client` (streaming
requests), `records` (what each request did), `metrics` (the project's metric
definitions), `runner` (the driver), `report` (table, JSON, PNG), `cli`, and
`fake_server` (a scripted server for tests and overhead measurements).
"""
