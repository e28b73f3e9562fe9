"""The Helm chart and deploy/, for tests: the functions of scripts/render_deploy.py (the
generator `make deploy` runs), loaded from there so tests render exactly as it does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "render_deploy.py"
_spec = importlib.util.spec_from_file_location("render_deploy", _SCRIPT)
assert _spec is not None and _spec.loader is not None
render_deploy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_deploy)

ROOT = render_deploy.ROOT
CHART = render_deploy.CHART
DEPLOY = render_deploy.DEPLOY
RELEASE = render_deploy.RELEASE
NAMESPACE = render_deploy.NAMESPACE
run_helm = render_deploy.run_helm
value_flags = render_deploy.value_flags
template = render_deploy.template
objects = render_deploy.objects
by_template = render_deploy.by_template
alert_rules_file = render_deploy.alert_rules_file
deploy_files = render_deploy.deploy_files
stale_files = render_deploy.stale_files
