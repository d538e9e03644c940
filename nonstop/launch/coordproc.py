"""The coordinator as its own process (``--store etcd://...``), started and restarted by node 0's
launcher: ``python -m nonstop.launch.coordproc SPEC_FILE RESTART``.

``SPEC_FILE`` (written by the launcher) holds the job id and the job's config. A restarted
coordinator resumes the job from its record in the control store (control/jobstore.py) while
every node keeps training. When the job has ended, the result is written to
``<job_dir>/coordinator-result.json``, which tells the launcher not to start it again.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path

from nonstop.config import job_config_from_json
from nonstop.control.jobstore import JobStore
from nonstop.control.secret import read_secret_file
from nonstop.control.store import open_store
from nonstop.launch.jobfiles import COORDINATOR_RESULT, result_to_json
from nonstop.launch.launcher import check_faults, serve_coordinator, worker_command


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    config = job_config_from_json(spec["config"])
    job_id = str(spec["job_id"])
    assert config.control.secret_file is not None  # required with a store (JobConfig checks it)
    secret = read_secret_file(config.control.secret_file, what="--secret-file")
    store = open_store(config.control.store, secret=secret.decode())
    try:
        result = serve_coordinator(
            config,
            job_id=job_id,
            command=worker_command(config.script, config.script_args),
            faults=check_faults(config),
            stop=threading.Event(),
            jobs=JobStore(store, job_id),
        )
    finally:
        store.close()
    out = config.job_dir.resolve() / COORDINATOR_RESULT
    tmp = out.with_suffix(".tmp")
    tmp.write_text(result_to_json(result))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
