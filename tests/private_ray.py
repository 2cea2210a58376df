"""A private local Ray for the tests, each with a dashboard port of its own.

Without a dashboard Ray still records one's address in its GCS (127.0.0.1:8265 by default), and Ray
Train's placement-group cleaner asks that address whether the run's controller is alive. Another
test process's dashboard at 8265 answers "no such actor", and the cleaner removes the live run's
placement group. A free port of its own leaves the question unanswered, and the cleaner waits.
"""

from __future__ import annotations

import socket

import ray


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_private_ray(num_cpus: int, **more) -> None:
    """``ray.init`` of a new local Ray on ``num_cpus`` CPUs, no dashboard, workers' logs not shown;
    ``more``: further ``ray.init`` options (a runtime env)."""
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        dashboard_port=free_port(),
        log_to_driver=False,
        **more,
    )
