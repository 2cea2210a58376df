"""Two Ray heads of cluster/local-up.sh on one machine, each on ports of its own, each given the
smoke sweep with `ray job submit` at the same time: both jobs SUCCEED, and each job's driver joined
the head it was submitted to. Before each head had a Ray temp folder of its own, Ray's job
supervisor gave a job the address of the latest head started on the machine (the shared
ray_current_cluster file): the first head's job ran on the second, and failed once that one
stopped."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray_head import started_head, submit_smoke

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_simultaneous_jobs_on_two_heads_each_run_on_their_own(real_dir, tmp_path):
    with started_head() as first, started_head() as second:
        heads = {"first": first, "second": second}
        with ThreadPoolExecutor(len(heads)) as pool:
            logs = dict(
                zip(
                    heads,
                    pool.map(
                        lambda name: submit_smoke(
                            heads[name][0],
                            heads[name][1],
                            ["--runtime-env", "cluster/runtime_env.yaml"],
                            real_dir,
                            tmp_path / name,
                        ),
                        heads,
                    ),
                    strict=True,
                )
            )
    for name, (_, _, _, (_, gcs_port)) in heads.items():
        joined = re.findall(r"jaxray: joined the Ray cluster at \S+:(\d+)", logs[name])
        assert joined == [str(gcs_port)], (name, gcs_port, logs[name][-3000:])
