"""Train a FOG model under one FP8 read policy.

    python train.py +experiment=reuse_rounded                 # the tiny default, on a CPU
    python train.py +experiment=fresh_reround model=fog_390m data=fineweb_edu
    python train.py -m +experiment=reuse_rounded,fresh_reround seed=0,1,2
    python train.py ... hydra.run.dir=DIR trainer.resume=true  # continue the run in DIR

Exit codes: 0 for a finished run, completed or diverged (a sweep goes on with its next job);
2 for a bad configuration or input (one line on stderr, and no run directory left behind unless
it held a run before), ranks that disagree included; 3 when another rank stopped answering
(frozen or lost: one line naming it, the step and the newest checkpoint, see
``readback.train.lost_ranks``); ``128 + signal`` after a preemption signal, once the checkpoint is
written (under submitit the job is requeued instead, see ``readback.train.preemption``); 130
after Ctrl-C, which saves a checkpoint after the current step and says how to continue (a second
Ctrl-C stops at once), with no traceback.
"""

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from readback.config import exit_on_bad_config, print_error, resume_of, undo_run_dir, validate
from readback.errors import ConfigError
from readback.stopping import ends_on_ctrl_c

_SWEEP_CONFIG_ERRORS: list[str] = []


def _config_error(error: ConfigError, run_dir: Path) -> None:
    """One line on stderr; the run directory removed if this job made it, else its Hydra files put
    back, unless another run took it over (nothing more written there); exit 2 (in a sweep the
    sweep goes on, and the process exits 2 at its end)."""
    from readback.train.checkpoint import RunDirTaken

    if not isinstance(error, RunDirTaken):
        hc = HydraConfig.get()
        undo_run_dir(run_dir, hydra_files={str(hc.output_subdir), f"{hc.job.name}.log"})
    print_error(error)
    if HydraConfig.get().mode == RunMode.MULTIRUN and "SUBMITIT_FOLDER" not in os.environ:
        _SWEEP_CONFIG_ERRORS.append(str(error))
        return
    sys.exit(2)


def _where_the_outputs_are(run_dir: Path) -> None:
    """A single run's last lines on stderr (rank 0): its folder, and the command that draws its
    loss and gradient-error plots and report."""
    if HydraConfig.get().mode == RunMode.RUN and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"outputs: {run_dir}\nplots and report: python -m readback.cli.analysis {run_dir} --html", file=sys.stderr
        )


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        # the typed config (a resume's: the run's own, laid under this command line's keys); a
        # sweep's jobs are checked here, one by one
        overrides, rank0 = list(HydraConfig.get().overrides.task), int(os.environ.get("RANK", "0")) == 0
        config = validate(resume_of(cfg, overrides, run_dir, launching=rank0))
        from readback.train import run

        run(config, run_dir)
        _where_the_outputs_are(run_dir)
    except ConfigError as error:
        _config_error(error, run_dir)
    except BaseException as error:
        from readback.train.lost_ranks import RankLost
        from readback.train.preemption import Preempted, exit_for_requeue

        if isinstance(error, Preempted):
            exit_for_requeue(error, run_dir)  # checkpoint written, no summary.json: requeue, or exit 128 + signal
        if isinstance(error, RankLost):
            print_error(error)  # the checkpoints are whole: a requeue or relaunch resumes
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RankLost.exit_code)  # no interpreter teardown: torch's may wait on the rank that is gone
        raise


if __name__ == "__main__":
    logging.raiseExceptions = False  # a log file on a full disk: its lines are lost, no traceback for each
    with ends_on_ctrl_c("train.py", "every checkpoint it wrote is kept (trainer.resume=true continues the newest)"):
        exit_on_bad_config(sys.argv[1:])
        main()
    if _SWEEP_CONFIG_ERRORS:
        sys.exit(2)
