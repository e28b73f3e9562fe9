"""Changes to a running local pool (`pdserve local -f pool.yaml`, the file edited while
it runs), and their rollouts: revisions are processes.

The manifest is read again whenever it changes. An edit that does not parse, or that
changes what cannot change while the pool runs (its name, model, or which roles it
has), is refused with the error and the running pool kept. A change to what a role's
workers run makes a new revision of that role:
- strategy `replace`: the new revision's workers start, then the old ones leave the
  router's table and drain (every worker of the role replaced);
- strategy `canary`: the new revision starts beside the stable one with the first
  step's share of workers and of traffic (the routing table's weights); each round
  the step is analysed on the pool's Prometheus (`rollout.analysis`) and decided
  (`rollout.decision`): wait, promote to the next step, complete (the new revision
  takes every worker, the old ones drain) or roll back (the canary's workers drain
  and the stable revision takes all traffic again).
The annotation `pdserve.dev/rollout: promote|abort` acts once per value and canary.
Each role's rollout is in `status.rollout` of the pool's status file, and in the
rollout metrics; scaling leaves a role alone while its rollout runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from prometheus_client import start_wsgi_server

from pdserve.operator import api, render
from pdserve.operator.local.pool import (
    LocalPool,
    LocalPoolError,
    load_manifest,
    role_revision,
    with_model_path,
)
from pdserve.operator.local.rounds import Rounds
from pdserve.operator.local.scaling import LocalScaler
from pdserve.operator.rollout import decision
from pdserve.operator.rollout.analysis import analyse
from pdserve.operator.rollout.metrics import RolloutMetrics
from pdserve.operator.scaling.prometheus import Prometheus
from pdserve.protocol.routing import RevisionWeight, RoutingFileError, read_table

log = logging.getLogger(__name__)

ANNOTATION = "pdserve.dev/rollout"
ROUND_S = 1.0
# The phases shown for the pool, the most pressing first.
_PRESSING: tuple[api.RolloutPhase, ...] = (
    "RolledBack", "Aborted", "Progressing", "Paused", "Completed",
)  # fmt: skip


def _now() -> datetime:
    return datetime.now(UTC)


@contextlib.contextmanager
def rolling_out(
    local: LocalPool,
    scaler: LocalScaler,
    manifest: Path | None,
    model_dir: Path | None = None,
    interval_s: float = ROUND_S,
) -> Iterator[LocalRollouts]:
    """Changes to `manifest` applied to the started pool `local` (`model_dir`: the
    checkpoint it serves in place of the manifest's), their rollouts decided on the
    Prometheus `scaler` reads and recorded in its status file, the rollout metrics
    served for that Prometheus to scrape, until the block ends."""
    metrics = RolloutMetrics()
    server, thread = start_wsgi_server(0, addr=local.host, registry=metrics.registry)
    local.extra_targets = [f"{local.host}:{server.server_port}"]
    if local.on_targets is not None:
        local.on_targets(local.targets())

    def read(path: Path) -> api.ServingPool:
        pool = load_manifest(path)
        return pool if model_dir is None else with_model_path(pool, model_dir)

    rollouts = LocalRollouts(
        local, manifest, scaler.prometheus_url, scaler.record_rollout, read=read,
        metrics=metrics, interval_s=interval_s,
    )  # fmt: skip
    rollouts.start()
    try:
        yield rollouts
    finally:
        rollouts.stop()
        server.shutdown()
        thread.join()


class LocalRollouts:
    """Watches a local pool's manifest and runs its rollouts (see the module's doc)."""

    def __init__(
        self,
        local: LocalPool,
        manifest: Path | None,
        prometheus_url: str | None,
        record: Callable[[api.RolloutStatus], None],
        *,
        read: Callable[[Path], api.ServingPool] = load_manifest,
        metrics: RolloutMetrics | None = None,
        interval_s: float = ROUND_S,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.local = local
        self.manifest = manifest
        self.prometheus_url = prometheus_url
        self.metrics = metrics or RolloutMetrics()
        self.status = api.RolloutStatus()
        self.strategies: dict[api.Role, api.RolloutStrategy] = {}
        self._record = record
        self._read = read
        self._clock = clock
        self._seen = manifest.read_bytes() if manifest is not None else b""
        self._acted: set[tuple[str, str]] = set()  # (annotation value, canary) acted on
        self._rounds = Rounds("local rollouts", self._next_round, lambda: interval_s)

    def start(self) -> None:
        """Watch and decide in a thread of its own."""
        self._rounds.start()

    def stop(self) -> None:
        """Stop after the round under way."""
        self._rounds.stop()

    async def _next_round(self, session: aiohttp.ClientSession) -> None:
        await asyncio.to_thread(self.check_manifest)
        await self.round(session)

    # -- the manifest ---------------------------------------------------------------------

    def check_manifest(self) -> bool:
        """Apply the manifest if it changed; whether a change was applied."""
        if self.manifest is None:
            return False
        try:
            data = self.manifest.read_bytes()
        except OSError:
            return False
        if data == self._seen:
            return False
        self._seen = data
        try:
            pool = self._read(self.manifest)
            self.apply(pool)
        except (LocalPoolError, api.InvalidPoolError, RoutingFileError) as error:
            self._say(f"{self.manifest}: change refused, the running pool is kept: {error}")
            return False
        return True

    def apply(self, changed: api.ServingPool) -> None:
        """Apply a changed manifest: each role whose workers' revision changed starts
        its rollout; other changes (replicas, the router's table) take effect at once.
        LocalPoolError for a change that cannot be made while the pool runs."""
        local = self.local
        pool = changed
        _check_changeable(local.pool, pool)
        local.pool = pool
        local.rewrite_routing()  # SLOs, buckets: the router re-reads its table
        for role in local.stable:
            self._role_changed(role, pool)
        self._report()

    def _role_changed(self, role: api.Role, pool: api.ServingPool) -> None:
        revision = role_revision(pool, role)
        workers = pool.spec.pool(role)
        assert workers is not None
        current = self.status.role(role)
        active = current is not None and current.phase in decision.ACTIVE
        if active and current is not None and revision == current.canary_revision:
            return
        if active and current is not None:
            self._finish(role, decision.decide(
                self.strategies[role], current, None, self._clock(), manual="abort"
            ))  # fmt: skip
        if revision == self.local.stable[role]:
            self.local.scale(role, workers.replicas)
            return
        self.local.specs[revision] = pool.spec
        if workers.rollout.type == "replace":
            self.local.rolling.add(role)
            try:
                self._replace(role, revision, workers.replicas)
            finally:
                self.local.rolling.discard(role)
            return
        self.strategies[role] = workers.rollout
        started = decision.start(self.local.stable[role], revision, workers.rollout, self._clock())
        self._say(f"{role}: {_text(started)}")
        self.local.rolling.add(role)
        self._set(role, started, decided=True)
        self._converge(role, started)

    def _replace(self, role: api.Role, revision: str, replicas: int) -> None:
        """Every worker of `role` replaced by one of `revision`: the new ones start,
        then the old ones drain."""
        old = self.local.stable[role]
        self._say(f"{role}: replacing {old} with {revision}")
        for _ in range(replicas):
            self.local.add(role, revision)
        self.local.stable[role] = revision
        while self.local.of_revision(role, old):
            self.local.remove(role, old)
        self._say(f"{role}: {revision} runs every worker")

    # -- the rounds -----------------------------------------------------------------------

    async def round(self, session: aiohttp.ClientSession) -> None:
        """Decide each role's rollout under way, and act on the decision."""
        for role in list(self.local.rolling):
            status = self.status.role(role)
            if status is None or status.phase not in decision.ACTIVE:
                continue
            strategy = self.strategies[role]
            analysis = await self._analyse(session, role, status, strategy)
            now = self._clock()
            following = decision.decide(strategy, status, analysis, now, self._manual(status))
            decided = following.last_decision != status.last_decision and (
                following.last_decision is None or following.last_decision.action != "wait"
            )
            if decided:
                self._say(f"{role}: {_text(following)}")
            if following.phase in decision.ACTIVE:
                self._set(role, following, decided)
                if following.step != status.step:
                    await asyncio.to_thread(self._converge, role, following)
            else:
                await asyncio.to_thread(self._finish, role, following)

    async def _analyse(
        self,
        session: aiohttp.ClientSession,
        role: api.Role,
        status: api.RoleRolloutStatus,
        strategy: api.RolloutStrategy,
    ) -> decision.Analysis | None:
        if self.prometheus_url is None:
            return None
        try:
            _, table = read_table(self.local.routing_file)
        except RoutingFileError:
            return None
        buckets = [table.bucket_label(i) for i in range(len(table.buckets))]
        return await analyse(
            Prometheus(self.prometheus_url, session), self.local.name, role, status, strategy,
            table.slo, buckets, self._clock(),
        )  # fmt: skip

    def _manual(self, status: api.RoleRolloutStatus) -> decision.Manual | None:
        """The annotation's command, once per value and canary."""
        value = self.local.pool.metadata.annotations.get(ANNOTATION)
        if value is None:
            self._acted.clear()  # removed: set again, it acts again
        if value not in ("promote", "abort") or status.canary_revision is None:
            return None
        key = (value, status.canary_revision)
        if key in self._acted:
            return None
        self._acted.add(key)
        return "promote" if value == "promote" else "abort"

    # -- acting ---------------------------------------------------------------------------

    def _converge(self, role: api.Role, status: api.RoleRolloutStatus) -> None:
        """The step's workers of each revision, then its traffic weights."""
        strategy, local = self.strategies[role], self.local
        workers = local.pool.spec.pool(role)
        replicas = workers.replicas if workers is not None else 1
        canary = status.canary_revision
        assert canary is not None
        wanted = {
            canary: decision.canary_workers(strategy, status, replicas),
            status.stable_revision: decision.stable_workers(strategy, status, replicas),
        }
        for revision, count in wanted.items():
            while len(local.of_revision(role, revision)) < count:
                local.add(role, revision)
        local.set_weights(role, _weights(status.stable_revision, canary, status.weight))
        for revision, count in wanted.items():
            while len(local.of_revision(role, revision)) > count:
                local.remove(role, revision)

    def _finish(self, role: api.Role, status: api.RoleRolloutStatus) -> None:
        """A rollout that ended: the revision that stays takes every worker and all
        traffic first, then the other one's workers drain, then the split goes."""
        local = self.local
        before = self.status.role(role)
        assert before is not None and before.canary_revision is not None
        if status.phase == "Completed":
            kept, gone = before.canary_revision, before.stable_revision
        else:
            kept, gone = before.stable_revision, before.canary_revision
        self._set(role, status, decided=True)
        workers = local.pool.spec.pool(role)
        replicas = workers.replicas if workers is not None else 1
        while len(local.of_revision(role, kept)) < replicas:
            local.add(role, kept)
        local.set_weights(role, _weights(gone, kept, 100))
        local.stable[role] = kept
        while local.of_revision(role, gone):
            local.remove(role, gone)
        local.set_weights(role, ())
        local.rolling.discard(role)
        self._say(f"{role}: {kept} serves every request")

    def _set(self, role: api.Role, status: api.RoleRolloutStatus, decided: bool) -> None:
        self.status = self.status.model_copy(update={role: status})
        self.metrics.record(self.local.name, role, status, decided)
        self._report()

    def _report(self) -> None:
        phases = [s.phase for s in (self.status.prefill, self.status.decode) if s is not None]
        phase = next((p for p in _PRESSING if p in phases), None)
        self.status = self.status.model_copy(update={"phase": phase})
        self._record(self.status)

    def _say(self, text: str) -> None:
        log.info("pool %s: %s", self.local.name, text)
        print(f"pool {self.local.name}: {text}", flush=True)


def _weights(stable: str, canary: str, weight: int) -> tuple[RevisionWeight, ...]:
    """The routing table's split: the stable revision first, so a growing canary share
    takes conversations over from it and never hands any back."""
    return (
        RevisionWeight(name=stable, weight=100 - weight),
        RevisionWeight(name=canary, weight=weight),
    )


def _text(status: api.RoleRolloutStatus) -> str:
    decision_ = status.last_decision
    if decision_ is None:
        return status.phase
    return f"{status.phase}: {decision_.action} ({decision_.reason}) {decision_.message}"


def _check_changeable(running: api.ServingPool, changed: api.ServingPool) -> None:
    """LocalPoolError for a change a running pool cannot take."""
    if changed.metadata.name != running.metadata.name:
        raise LocalPoolError("the pool's name cannot change while it runs (restart it)")
    if changed.spec.model.name != running.spec.model.name:
        raise LocalPoolError("the model cannot change while the pool runs (restart it)")
    for role in render.ROLES:
        if (changed.spec.pool(role) is None) != (running.spec.pool(role) is None):
            raise LocalPoolError(f"the {role} role cannot come or go while the pool runs")
