"""``python -m readback.cli.sync DIR [DIR ...] [--project P] [--entity E] [--dry-run]``

Uploads the offline wandb runs under sweep (or run) directories: every
``<run dir>/wandb/offline-run-<time>-<id>`` folder, passed to ``wandb sync`` in one call. A
requeued job leaves one folder per start under the same run id; ``wandb sync`` uploads the
folders of one id one after the other in start order, into that one run. Before uploading it
prints each run (id, name, group, how many folders). Needs a wandb login for the upload;
``--dry-run`` lists what would be uploaded without network.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from readback.stopping import ends_on_ctrl_c
from readback.sync import OFFLINE_FOLDER, offline_folders, read_offline_run


@ends_on_ctrl_c("python -m readback.cli.sync")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m readback.cli.sync", description=__doc__.split("\n\n")[1])
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="a sweep or run directory")
    parser.add_argument("--project", "-p", default=None, help="upload into this project (default: the run's)")
    parser.add_argument("--entity", "-e", default=None, help="upload into this entity (default: the run's)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; upload nothing")
    args = parser.parse_args(argv)
    for d in args.dirs:
        if not Path(d).is_dir():
            print(f"error: no such directory: {d}", file=sys.stderr)
            return 2
    folders = offline_folders(*args.dirs)
    if not folders:
        print(f"error: no offline wandb runs (wandb/offline-run-*) under {', '.join(args.dirs)}", file=sys.stderr)
        return 2
    by_id: dict[str, list[Path]] = {}
    for f in folders:
        by_id.setdefault(OFFLINE_FOLDER.match(f.name).group(2), []).append(f)  # type: ignore[union-attr]
    for run_id, fs in by_id.items():
        info = read_offline_run(fs[-1])
        count = f"{len(fs)} folder{'s' * (len(fs) > 1)}"
        print(f"{run_id}  {info.get('name', '')!s:40}  group {info.get('group', '')}  ({count})")
    wandb_cli = shutil.which("wandb") or str(Path(sys.executable).with_name("wandb"))
    cmd = [wandb_cli, "sync", "--yes", *(["--dry-run"] if args.dry_run else [])]
    cmd += [*(["--project", args.project] if args.project else []), *(["--entity", args.entity] if args.entity else [])]
    print(
        f"{len(by_id)} runs in {len(folders)} folders: {'wandb sync --dry-run' if args.dry_run else 'wandb sync'}",
        flush=True,
    )
    return subprocess.run(cmd + [str(f) for f in folders], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
