"""Values computed once per test run and shared by the pytest-xdist workers (the session's prefills, the greedy
reference, the press masks). A module of its own so that no test imports `conftest` by name: with a second
conftest.py (tests/integration/vllm/) the name `conftest` can be that one."""

from __future__ import annotations

import os


def shared(tmp_path_factory, name: str, compute):
    """compute() once per test run. Under pytest-xdist the first worker to ask computes it and saves it in
    the run's temporary root (which all workers share), under a file lock; the others wait and load it.
    Only for this run's own values (nothing is reused across runs)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    import torch
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / f"shared-{name}.pt"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return torch.load(path, weights_only=False)  # written by a worker of this run
        value = compute()
        torch.save(value, path)
        return value
