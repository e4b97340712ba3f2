"""Train a FOG model under one FP8 read policy.

    python train.py +experiment=reuse_rounded                 # the tiny default, on a CPU
    python train.py +experiment=fresh_reround model=fog_390m data=fineweb_edu
    python train.py -m +experiment=reuse_rounded,fresh_reround seed=0,1,2
"""

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from readback.config import exit_on_bad_config, validate
from readback.errors import ConfigError


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
    except ConfigError as error:  # a sweep job with a bad value: leave nothing behind
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    from readback.train import run

    run(cfg, run_dir)


if __name__ == "__main__":
    exit_on_bad_config(sys.argv[1:])
    main()
