"""The PromQL the autoscaler and the pool's conditions read (pure: text only).

Every query selects one pool (`pool`, and `namespace` where Prometheus adds it, as a
ServiceMonitor or the scrape annotations do) and looks back one window. Latencies
come from the router's histograms (role="router": what clients see), or from the
decode workers' when no router reports (a pool without one); loads from the
workers' gauges, averaged over the window so one scrape does not decide.
"""

from __future__ import annotations

from dataclasses import dataclass

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
ROUTER = 'role="router"'
SERVING = 'role=~"decode|both"'  # the workers that stream tokens to clients
WORKERS = 'role=~"prefill|decode|both"'


def _duration(seconds: float) -> str:
    """A PromQL duration: 90 -> 90s, 0.5 -> 500ms."""
    if seconds >= 1 and float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


@dataclass(frozen=True)
class PoolQueries:
    """The queries about one pool over one window."""

    pool: str
    namespace: str | None = None  # None: Prometheus adds no namespace label
    window_seconds: float = 60.0

    @property
    def window(self) -> str:
        """The range of range vectors: [60s]."""
        return f"[{_duration(self.window_seconds)}]"

    def select(self, *matchers: str) -> str:
        """The label matchers of this pool plus `matchers`: {pool="a",role="router"}."""
        own = [f'pool="{_escape(self.pool)}"']
        if self.namespace is not None:
            own.append(f'namespace="{_escape(self.namespace)}"')
        return "{" + ",".join([*own, *matchers]) + "}"

    def _router_or_workers(self, template: str, *matchers: str) -> str:
        """`template` over the router's series, or the serving workers' where the router
        has none (`{sel}` in it stands for the selector, with `matchers` added)."""
        router = template.format(sel=self.select(ROUTER, *matchers))
        workers = template.format(sel=self.select(SERVING, *matchers))
        return f"({router}) or ({workers})"

    # -- latencies and traffic ----------------------------------------------------------

    def ttft_quantile(self, quantile: float, mode: str | None = None) -> str:
        """TTFT at `quantile` (0-1), by the mode requests were served in, or of the
        requests served in one `mode`."""
        grouping = "mode, le" if mode is None else "le"
        matchers = () if mode is None else (f'mode="{_escape(mode)}"',)
        return self._router_or_workers(
            f"histogram_quantile({quantile:g}, sum by ({grouping}) "
            f"(rate({TTFT}_bucket{{sel}}{self.window})))",
            *matchers,
        )

    def itl_quantile(self, quantile: float) -> str:
        """ITL at `quantile` (0-1), over every gap between tokens."""
        return self._router_or_workers(
            f"histogram_quantile({quantile:g}, sum by (le) "
            f"(rate({ITL}_bucket{{sel}}{self.window})))"
        )

    def requests(self) -> str:
        """Requests that got a first token in the window (the latencies' sample size)."""
        return self._router_or_workers(f"sum(increase({TTFT}_count{{sel}}{self.window}))")

    def request_rate(self) -> str:
        """Requests answered per second (router), or ended per second (workers)."""
        router = f"sum(rate(pdserve_router_requests_total{self.select()}{self.window}))"
        workers = f"sum(rate(pdserve_requests_total{self.select(SERVING)}{self.window}))"
        return f"({router}) or ({workers})"

    # -- worker loads -------------------------------------------------------------------

    def per_worker(self, gauge: str) -> str:
        """A worker gauge averaged over the window, then over each role's workers."""
        return f"avg by (role) (avg_over_time({gauge}{self.select(WORKERS)}{self.window}))"

    def role_average(self, gauge: str, role: str) -> str:
        """A worker gauge averaged over the window and over the workers `role` (a
        label matcher) selects: one number."""
        return f"avg(avg_over_time({gauge}{self.select(role)}{self.window}))"

    def workers(self) -> str:
        """Workers of each role reporting now."""
        return f"count by (role) (pdserve_requests_running{self.select(WORKERS)})"

    # -- disaggregation -----------------------------------------------------------------

    def disaggregated_routed(self) -> str:
        """Requests per second the router sent down a disaggregated bucket's path."""
        routed = self.select('mode="disaggregated"')
        return f"sum(rate(pdserve_router_decisions_total{routed}{self.window}))"

    def disaggregated_served(self) -> str:
        """Requests per second answered after a prefill worker's hand-off."""
        served = self.select('mode="disaggregated"', 'outcome="ok"')
        return f"sum(rate(pdserve_router_requests_total{served}{self.window}))"

    def fallbacks(self) -> str:
        """Disaggregated requests served colocated, per second, by why."""
        return f"sum by (reason) (rate(pdserve_router_fallbacks_total{self.select()}{self.window}))"

    def transfers(self) -> str:
        """KV transfers per second that completed, as decode workers saw them."""
        decode = self.select('role="decode"')
        return f"sum(rate(pdserve_kv_transfer_duration_seconds_count{decode}{self.window}))"

    def transfer_failures(self) -> str:
        """Failed hand-offs per second, as decode workers saw them, by cause."""
        decode = self.select('role="decode"')
        return f"sum by (reason) (rate(pdserve_kv_transfer_failures_total{decode}{self.window}))"

    def prefill_available(self) -> str:
        """Prefill workers that take traffic now: as the router sees them, or as
        Prometheus scrapes them where no router reports."""
        router = self.select(ROUTER, 'target="prefill"', 'state="available"')
        prefill = self.select('role="prefill"')
        return (
            f"(max(pdserve_router_workers{router})) or (count(pdserve_requests_running{prefill}))"
        )

    def reporting(self) -> str:
        """Series of the pool's workers and router now: none means Prometheus does not
        scrape the pool."""
        sel = self.select()
        return f"count(pdserve_requests_running{sel} or pdserve_router_workers{sel})"
