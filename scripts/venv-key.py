"""Print the cache key of the virtual environment: a hash of the dependency lists in
pyproject.toml and the Python version, so unrelated edits keep the cached venv."""

import hashlib
import json
import sys
import tomllib

with open("pyproject.toml", "rb") as handle:
    project = tomllib.load(handle)["project"]
deps = {
    "dependencies": project.get("dependencies", []),
    "optional": project.get("optional-dependencies", {}),
}
digest = hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()[:12]
print(f"{digest}-py{sys.version_info[0]}{sys.version_info[1]}")
