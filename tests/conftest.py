"""Test configuration: runtime shape/type checking of the package (jaxtyping + beartype).

The import hook must be installed before anything imports ``nnsight_lorsa``; the package itself
never imports beartype (code that may run on an NDIF server must not need it).
"""

from __future__ import annotations

import os
import sys

import pytest

# No nested OpenMP teams (set before torch loads libgomp; .ci/run exports it too): MKL's divide-and-conquer SVD
# (dgesdd: torch.linalg.svd in the Lorsa recipe's init) runs parallel dgemm inside parallel regions, and libgomp keeps
# each nested team alive — one suite run reached 1009 threads (945 idle) and a load of 200, stuck in
# test_lorsa_recipe (py-spy: GOMP_parallel <- mkl_blas_dgemm <- mkl_lapack_dlasd3 <- dgesdd).
os.environ.setdefault("OMP_MAX_ACTIVE_LEVELS", "1")
# An xdist worker (the default run: one a core) takes one OpenMP / torch thread: two workers of two threads each on
# two cores spin-wait against each other (libgomp), and the suite ran ~5x slower than serially.
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
install_import_hook("nnsight_lorsa", "beartype.beartype")
torch.set_num_threads(1 if XDIST_WORKER else min(2, torch.get_num_threads()))

# Property-based tests: random examples on a developer's machine (they explore), the same examples on CI
# (``CI`` set: derandomized, so a landing never hinges on which inputs a run happened to draw).
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Import (and so type-check-decorate) the package before anything imports nnsight: decorating a
# module's functions after nnsight has patched torch trips beartype ("unhashable instancemethod").
import nnsight_lorsa  # noqa: E402,F401
import nnsight_lorsa.envoy.lorsa_set  # noqa: E402,F401
import nnsight_lorsa.training.evaluate  # noqa: E402,F401
import nnsight_lorsa.training.trainer  # noqa: E402,F401


def _torch_globals() -> dict[str, object]:
    """The process-wide torch state a test could leave changed for the tests after it (on one xdist
    worker): grad mode, default dtype and device, and the stack of torch function modes (``with
    torch.device(...)`` is one)."""
    return {"grad enabled": torch.is_grad_enabled(), "default dtype": torch.get_default_dtype(),
            "default device": torch.get_default_device(),
            "torch function modes": torch._C._len_torch_function_stack()}


@pytest.fixture(autouse=True)
def _no_leaked_torch_state():
    """Fail the test that changes torch's global state without restoring it (a leak makes later tests
    fail in ways that depend on the test order, which is what a GPU run with xdist showed)."""
    before = _torch_globals()
    yield
    after = _torch_globals()
    leaked = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if leaked:
        torch.set_grad_enabled(bool(before["grad enabled"]))
        torch.set_default_dtype(before["default dtype"])  # type: ignore[arg-type]
        pytest.fail(f"the test left torch's global state changed (before, after): {leaked}")


_TEMP_BEFORE: list[set[str]] = []  # the temp folder's entries when the run started (the controller's)
_TEMP_OWN = ("pytest-of-", "torchinductor_")  # pytest's own base folder, torch.compile's cache


def _temp_entries() -> set[str]:
    import tempfile

    return {p for p in os.listdir(tempfile.gettempdir()) if not p.startswith(_TEMP_OWN)}


def pytest_report_header(config: pytest.Config) -> str:
    """The free disk under the temp folder: a run writes ~0.5 GB to tmp_path (passing tests' folders are removed,
    ``tmp_path_retention_policy``), and a full disk shows up as errors at the setup of the run's last tests."""
    import shutil
    import tempfile

    _TEMP_BEFORE.append(_temp_entries())
    free = shutil.disk_usage(tempfile.gettempdir()).free
    return f"free disk under {tempfile.gettempdir()}: {free / 2**30:.1f} GiB"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Names what appeared in the temp folder during the run outside pytest's own folders: a test (or a doc
    example, a subprocess) that left it there. Other programs on the machine may add entries too, so this is a
    report, not a failure; a clean CI machine shows none."""
    if not _TEMP_BEFORE or hasattr(config, "workerinput"):
        return
    new = sorted(_temp_entries() - _TEMP_BEFORE[0])
    if new:
        terminalreporter.write_sep("=", f"{len(new)} entries appeared in the temp folder during the run")
        terminalreporter.write_line(", ".join(new[:20]) + (" ..." if len(new) > 20 else ""))
