"""The torchrun half of test_fsdp.py: every 2-process run in one launch (each process imports torch once).

``python -m torch.distributed.run --nproc-per-node 2 fsdp_worker.py JOBS.json``; each job is
``{"dir", "config", "stops": [steps to stop and checkpoint at], "snapshot": dir to copy the run to after
the stops, or null}``. Every run ends finished, but a ``"busy"`` job's: its directory is locked by the
test process (that PID), so every rank must refuse it; each writes the message to ``refused-RANK.txt``.
And a ``"plant": [name, target]`` job's: after its stops rank 0 makes ``name`` a symlink to ``target``, and
every rank must refuse to go on (one that did not would leave the others waiting at a barrier).
"""

from __future__ import annotations

import json
import shutil
import sys

from pathlib import Path

import torch.distributed as dist

from moga.filelock import DirectoryBusy
from moga.files import UnsafeFile
from moga.train import run


def main(jobs_path: str) -> None:
    dist.init_process_group("gloo")  # run() joins this group instead of making its own
    try:
        for job in json.loads(open(jobs_path).read()):
            if job.get("busy"):
                try:
                    run(job["config"], job["dir"], quiet=True)
                except DirectoryBusy as e:
                    assert e.holder == job["busy"], (e.holder, job["busy"])
                    (Path(job["dir"]) / f"refused-{dist.get_rank()}.txt").write_text(str(e))
                    continue
                raise AssertionError(f"rank {dist.get_rank()} trained in a run directory another process holds")
            for stop in job.get("stops", []):
                assert run(job["config"], job["dir"], stop_at=stop, quiet=True)["status"] == "stopped"
            if job.get("plant"):
                name, target = job["plant"]
                if dist.get_rank() == 0:
                    (Path(job["dir"]) / name).symlink_to(target)
                dist.barrier()
                try:
                    run(job["config"], job["dir"], quiet=True)
                except UnsafeFile as e:
                    (Path(job["dir"]) / f"refused-{dist.get_rank()}.txt").write_text(str(e))
                    continue
                raise AssertionError(f"rank {dist.get_rank()} trained through a symlink at {name}")
            if job.get("snapshot"):
                if dist.get_rank() == 0:
                    shutil.copytree(job["dir"], job["snapshot"])
                dist.barrier()
            assert run(job["config"], job["dir"], quiet=True)["status"] == "finished"
        dist.barrier()  # no rank closes its connections while another still uses them (gloo aborts on that)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
