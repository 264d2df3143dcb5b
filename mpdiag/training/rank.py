"""One rank of a job that ``python -m mpdiag run SCRIPT --nproc N`` launched (see mpdiag.training.distributed).

Owns only the entry point: read the launch spec the launching process wrote and train it with the run id that
process created. Must not create runs or open the store itself (the runner decides, by rank, who writes).
"""

import json
import os

from mpdiag.training.distributed import SPEC_ENV, exit_skipping_finalization
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript


def main() -> None:
    with open(os.environ[SPEC_ENV]) as f:
        spec = json.load(f)
    train(ModelScript(filename=spec["filename"], source=spec["source"]), RunConfig.from_dict(spec["config"]),
          spec["store"], run_id=spec["run_id"])


if __name__ == "__main__":
    main()
    # The run is ended and the store closed. The process group is deliberately never destroyed, and the process
    # ends without finalization: destroying a gloo group joins its worker threads while holding the GIL, and a
    # worker still releasing a finished all_gather's Python tensors waits for the GIL, so the rank would hang
    # for ever (py-spy: ~ProcessGroupGloo in std::thread::join against ~AsyncAllgatherWork in
    # gil_scoped_acquire), and the launcher with it.
    exit_skipping_finalization(0)
