"""How a test file that needs a framework says it cannot run, in one place for python/tests (as
tests/common/skip.rs is for the Rust tests).

A file that needs megatron-core, transformers or trl calls `framework` before importing anything
from it. Where the framework does not import, the file is skipped, saying why, and conftest.py puts
the line into the run's closing list (GRADBUS_SKIP_LOG). Where GRADBUS_REQUIRE names it - python/test.sh
sets that for every framework it installed - the failed import fails the run instead: the frameworks
are installed without their dependencies (python/requirements-frameworks.txt pins them all), so one
dependency missing from the list would otherwise skip a whole file and leave the run green."""

import importlib
import os

import pytest


def required():
    """The capabilities GRADBUS_REQUIRE names (a comma-separated list)."""
    return {c.strip() for c in os.environ.get("GRADBUS_REQUIRE", "").split(",") if c.strip()}


def framework(module, capability):
    """Import `module` for the calling test file; skip the file without it, unless `capability` is
    required here (then the import error is raised, naming the requirement)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if capability in required():
            raise ImportError(
                f"GRADBUS_REQUIRE names {capability!r} (python/test.sh installed it), so its tests must run here, "
                f"yet `import {module}` fails: {e!r}") from e
        pytest.skip(f"{module} does not import ({e!r}); python/requirements-frameworks.txt installs it",
                    allow_module_level=True)
