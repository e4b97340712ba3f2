"""``python -m readback.cli.te_table``: prints docs/te_backend.md's experiment -> Transformer Engine
table (:mod:`readback.backends.te.table`), each row's config composed from ``conf/`` as a run's is."""

from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from readback.backends.te.table import render
from readback.config import CONF_DIR, typed


def main() -> None:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        print(render(lambda overrides: typed(hydra_compose("train", overrides=overrides))))


if __name__ == "__main__":
    main()
