"""One rank of a job that ``python -m mpdiag run SCRIPT --nproc N`` launched (see mpdiag.training.distributed).

Owns only the entry point: read the launch spec the launching process wrote and train it with the run id that
process created. Must not create runs or open the store itself (the runner decides, by rank, who writes).
"""

import json
import os
import sys

from mpdiag.training.distributed import SPEC_ENV
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript


def main() -> None:
    with open(os.environ[SPEC_ENV]) as f:
        spec = json.load(f)
    train(ModelScript(filename=spec["filename"], source=spec["source"]), RunConfig.from_dict(spec["config"]),
          spec["store"], run_id=spec["run_id"])


if __name__ == "__main__":
    main()
    # The run is ended and the store closed. Skip interpreter finalization: gloo's worker threads outlive
    # destroy_process_group() and may still be releasing a finished collective's tensors, which needs the GIL;
    # during finalization that aborts the rank (std::terminate, SIGABRT), and the launcher would then report a
    # finished job as failed. Seen under CPU load with FSDP2, reproduced without mpdiag.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
