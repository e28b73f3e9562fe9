# Installing pdserve: the Helm chart (charts/pdserve), the kustomize base generated
# from it (deploy/), the dashboard and alert rules, and the container images.
#   make helm-bin   build Helm from its Go module once (cached by version under ~/.cache/pdserve)
#   make deploy     regenerate deploy/ from the chart's default values (after changing the chart)
#   make images     build the operator and worker images with buildah (root; cached)

.PHONY: helm-bin deploy images

helm-bin:
	@scripts/build-helm.sh >/dev/null

# The chart's tests (tests/integration/test_chart.py, tests/e2e/test_chart.py) run Helm.
unit e2e: helm-bin

deploy: venv helm-bin
	$(PY) scripts/render_deploy.py

# The worker image holds CUDA torch (about 6 GB): its build is here, not in CI.
images:
	@start=$$(date +%s); scripts/build-images.sh operator worker; \
	echo "make images: $$(($$(date +%s) - start))s" >&2
