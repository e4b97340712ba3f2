"""A checkpoint's index names its paths under the module the writing Python pickles them in:
``pathlib`` up to 3.12, ``pathlib._local`` from 3.13. A 3.13 run's checkpoints load on 3.13 (they
were refused as code before), an older one's on every Python; one written by 3.13 is refused in one
line by an older Python, which cannot read it; and nothing else gets through by the renaming."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch

from readback.errors import ConfigError
from readback.train.checkpoint import io as checkpoint_io
from readback.train.checkpoint import load_checkpoint
from readback.train.checkpoint.dirs import checkpoint_path
from readback.train.checkpoint.manager import CheckpointManager
from readback.train.distributed import DistEnv
from toys import ToyModel, make_cfg

SPELLINGS = {"3.12": b"cpathlib\nPosixPath\n", "3.13": b"cpathlib._local\nPosixPath\n"}  # as Python <= 3.12, >= 3.13


@pytest.fixture
def checkpoint(tmp_path):
    model = ToyModel(8)
    manager = CheckpointManager(
        tmp_path,
        make_cfg(),
        DistEnv(),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        shared={},
        per_rank={},
    )
    manager.save(1, wandb_run_id=None)
    return checkpoint_path(tmp_path / "checkpoints", 1)


def _index_as_written_by(path, python: str) -> bytes:
    """The checkpoint's index pickled (protocol 2: module names as plain text) as ``python`` would."""
    raw = pickle.dumps(checkpoint_io.read_index(path), protocol=2)
    for spelling in SPELLINGS.values():
        raw = raw.replace(spelling, SPELLINGS[python])
    assert raw.count(SPELLINGS[python]) == 1  # the path the index holds: the test changes something
    return raw


READABLE = ["3.12", "3.13"] if sys.version_info >= (3, 13) else ["3.12"]


@pytest.mark.parametrize("python", READABLE)
def test_an_index_written_by_this_or_an_older_python_loads(checkpoint, python):
    expected = checkpoint_io.read_index(checkpoint).storage_meta.checkpoint_id
    (checkpoint / checkpoint_io.INDEX).write_bytes(_index_as_written_by(checkpoint, python))
    assert checkpoint_io.read_index(checkpoint).storage_meta.checkpoint_id == expected
    assert load_checkpoint(checkpoint)["model"].keys() == ToyModel(8).state_dict().keys()


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="Python 3.13 reads what it writes")
def test_an_index_written_by_python_313_is_refused_in_one_line_by_an_older_python(checkpoint):
    (checkpoint / checkpoint_io.INDEX).write_bytes(_index_as_written_by(checkpoint, "3.13"))
    with pytest.raises(ConfigError, match=r"written by Python 3\.13 or newer.*resume it on Python 3\.13\+$"):
        load_checkpoint(checkpoint)


@pytest.mark.skipif(sys.version_info < (3, 13), reason="an older Python refuses the module whole (above)")
def test_the_renaming_lets_nothing_else_of_that_module_through(checkpoint):
    raw = _index_as_written_by(checkpoint, "3.13").replace(SPELLINGS["3.13"], b"cpathlib._local\nPath.unlink\n")
    (checkpoint / checkpoint_io.INDEX).write_bytes(raw)
    with pytest.raises(ConfigError, match=r"unsupported GLOBAL pathlib\.Path\.unlink"):
        load_checkpoint(checkpoint)
