"""pdserve control plane: the ServingPool API, rendering, the kopf operator."""

if __name__ == "operator":  # pragma: no cover - depends on how Python was started
    # This folder is the `pdserve.operator` package. It is imported under the bare
    # name `operator` only when the repository root is on sys.path (`python -m ...`
    # or `python -c ...` run from the root), where it would shadow the standard
    # library module of that name. Hand the standard library module to whoever
    # asked for it, so that such runs keep working. Only modules that are loaded
    # before `operator` itself may be used here (else the import is circular).
    import os
    import sys
    from importlib import _bootstrap, _bootstrap_external

    _path = os.path.join(os.path.dirname(os.__file__), "operator.py")
    _loader = _bootstrap_external.SourceFileLoader("operator", _path)
    _stdlib_operator = _bootstrap.module_from_spec(_bootstrap.ModuleSpec("operator", _loader))
    sys.modules["operator"] = _stdlib_operator
    _loader.exec_module(_stdlib_operator)
