"""Bad input, tried as a new user would, through the real ``python train.py``: each case must
end with ONE line on stderr naming the problem and the fix, exit code 2, no traceback (unless
``HYDRA_FULL_ERROR=1``), and no run directory -- or, when the run directory held a run before, that
run left as it was.

The cases run a few at a time (each is a fresh Python process: most of its time is imports).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from readback.data import Layout, build_data
from readback.train.checkpoint import io as checkpoint_io
from readback.train.checkpoint import list_checkpoints
from readback.train.checkpoint.lock_holder import this_process
from readback.train.checkpoint.writer_lock import lock_path
from toys import REPO, TWO_STEP_RUN, load_data_cfg

# Small enough to train in seconds; cases override what they break.
TINY = [
    *TWO_STEP_RUN,
    "trainer.ckpt_every=1",
]
NO_CUDA = not torch.cuda.is_available()
WORKERS = 2 * (os.cpu_count() or 2)  # the processes wait on imports and disk as much as on the CPU

# (id, overrides, extra environment, what the line must say). ``{tmp}`` is the test's tmp dir,
# ``{run}`` the existing run directory (a finished 2-step run with checkpoints).
CASES = [
    (
        "unknown_policy",
        ["policy=foo"],
        {},
        "policy='foo' is not valid; valid: reuse_rounded, fresh_reround, no_saved_copy, original, exact",
    ),
    (
        "unknown_model",
        ["model=huge"],
        {},
        "model='huge' is not valid; valid: fog_1p5b, fog_390m, fog_8b, hf, small, tiny",
    ),
    ("unknown_experiment", ["+experiment=nope"], {}, "experiment='nope' is not valid; valid: bf16_baseline"),
    ("typo_group", ["polcy=exact"], {}, "polcy='exact' is not a config key; did you mean policy?"),
    ("typo_key", ["trainer.stepz=5"], {}, "trainer.stepz='5' is not a config key; did you mean trainer.steps?"),
    (
        "key_of_other_option",
        ["data=shakespeare", "data.noise=0.5"],
        {},
        "data.noise='0.5' is not a key of data=shakespeare; it is one of data=synthetic",
    ),
    ("steps_not_int", ["trainer.steps=abc"], {}, "trainer.steps='abc' is not valid; valid: an integer >= 1"),
    ("margin_float", ["precision.margin=1.5"], {}, "precision.margin=1.5 is not valid; valid: an integer >= 0"),
    (
        "site_margin_unknown",
        ["precision.site_margin={{attn.kore.output:14}}"],
        {},
        "precision.site_margin='attn.kore.output' is not valid; valid: site patterns (globs) matching attn.qkv.input",
    ),
    ("data_value_type", ["data.n_tokens=lots"], {}, "data.n_tokens='lots' is not valid; valid: an integer"),
    ("resume_not_bool", ["trainer.resume=maybe"], {}, "trainer.resume='maybe' is not valid; valid: true, false"),
    ("zero_steps", ["trainer.steps=0"], {}, "trainer.steps=0 is not valid; valid: an integer >= 1"),
    ("negative_width", ["model.d_model=-64"], {}, "model.d_model=-64 is not valid; valid: an integer >= 1"),
    ("negative_lr", ["model.lr=-1"], {}, "model.lr=-1.0 is not valid; valid: a positive number"),
    (
        "heads_not_dividing",
        ["model.n_heads=3"],
        {},
        "model.n_heads=3 is not valid; valid: a divisor of model.d_model=32",
    ),
    (
        "fp8_width",
        ["model.d_model=72", "model.n_heads=4"],
        {},
        "model.d_model=72 is not valid; valid: a multiple of 16 under precision=fp8",
    ),
    (
        "fp8_ffn",
        ["model.ffn_dim=100"],
        {},
        "model.ffn_dim=100 is not valid; valid: a multiple of 16 under precision=fp8",
    ),
    (
        "missing_file",
        ["data=shakespeare", "data.files=[/nonexistent.txt]"],
        {},
        "data.files='/nonexistent.txt' is not valid; valid: existing text files",
    ),
    ("empty_file", ["data=shakespeare", "data.files=[{tmp}/empty.txt]"], {}, "valid: non-empty text files"),
    ("blank_file", ["data=shakespeare", "data.files=[{tmp}/blank.txt]"], {}, "(its 5 bytes are all blank)"),
    (
        "cut_token_shard",  # the cached token ids of a local text, cut short: refused in the run, before step 1
        ["data=shakespeare", "data.files=[{tmp}/small.txt]", "data.vocab_size=300", "data.block_lines=20"]
        + ["data.cache_dir={tmp}/cache"],
        {},
        "tokens-b20.bin' is not valid; valid: a cache file this run can read, and it is truncated: it holds",
    ),
    ("probe_repeats", ["probe.repeats=0"], {}, "probe.repeats=0 is not valid; valid: an integer >= 1"),
    (
        "micro_batch",
        ["trainer.micro_batch=3"],
        {},
        "trainer.micro_batch=3 is not valid; valid: a divisor of model.global_batch=4",
    ),
    (
        "fp8_format",
        ["precision.fp8_format=E9M9"],
        {},
        "precision.fp8_format='E9M9' is not valid; valid: null, E4M3, HYBRID",
    ),
    (
        "bwd_precision",
        ["attention.bwd_precision=fp16"],
        {},
        "attention.bwd_precision='fp16' is not valid; valid: fp8, bf16, fp32",
    ),
    (
        "old_policy_key",
        ["policy.name=fresh_reround"],
        {},
        "policy.name='fresh_reround' is not a config key any more: it is policy (e.g. policy=fresh_reround)",
    ),
    (
        "old_attention_recipe_key",
        ["precision.attention_recipe=delayed"],
        {},
        "precision.attention_recipe='delayed' is not a config key any more: it is attention.recipe",
    ),
    (
        "override_precision",
        ["precision.override_linear_precision=[true]"],
        {},
        "precision.override_linear_precision=[True] is not valid; valid: three booleans [fprop, dgrad, wgrad]",
    ),
    (
        "cooldown",
        ["trainer.optim.cooldown_frac=2"],
        {},
        "trainer.optim.cooldown_frac=2.0 is not valid; valid: a number in [0, 1]",
    ),
    ("parallel", ["trainer.parallel=zero3"], {}, "trainer.parallel='zero3' is not valid; valid: ddp, fsdp"),
    ("gpu_memory", ["trainer.gpu_memory_gb=0"], {}, "trainer.gpu_memory_gb=0.0 is not valid; valid: a positive number"),
    (
        "dry_run_too_big",
        [
            "trainer.dry_run=true",
            "model.n_layers=32",
            "model.d_model=4096",
            "model.n_heads=32",
            "model.n_kv_groups=8",
            "model.ffn_dim=21504",
            "model.vocab_size=131072",
            "model.seq_len=4096",
            "trainer.micro_batch=1",
        ],
        {},
        "trainer.gpu_memory_gb=80.0 is not valid; valid: at least the estimated 143.3 GB per GPU of "
        "trainer.parallel=ddp on 1 GPU(s) (30.1 params, 30.1 grads, 60.1 AdamW, 23.1 activations); "
        "try trainer.parallel=fsdp",
    ),  # 8B, tied
    ("signal_name", ["trainer.preempt_signals=[SIGFOO]"], {}, "trainer.preempt_signals=['SIGFOO'] is not valid"),
    ("unwritable_dir", ["hydra.run.dir=/proc/x"], {}, "hydra.run.dir='/proc/x' is not valid; valid: a directory path"),
    (
        "parent_is_a_file",
        ["hydra.run.dir={tmp}/empty.txt/run"],
        {},
        "empty.txt is not a directory)",
    ),
    ("data_vocab", ["data.vocab_size=1"], {}, "data.vocab_size=1 is not valid; valid: an integer >= 2"),
    # what parses but makes no sense: non-finite numbers, values out of range, a model vocabulary
    # below the data's, list entries naming nothing, +keys nothing reads, files that are not text
    ("infinite_number", ["trainer.optim.eps=inf"], {}, "trainer.optim.eps=inf is not valid; valid: a positive number"),
    (
        "nan_number",
        ["trainer.optim.grad_clip=nan"],
        {},
        "trainer.optim.grad_clip=nan is not valid; valid: a finite number >= 0",
    ),
    (
        "divergence_factor",
        ["trainer.divergence.factor=1"],
        {},
        "trainer.divergence.factor=1.0 is not valid; valid: a finite number > 1",
    ),
    (
        "beta_range",
        ["trainer.optim.betas=[0.9,1.5]"],
        {},
        "trainer.optim.betas=[0.9, 1.5] is not valid; valid: two numbers in [0, 1)",
    ),
    (
        "model_vocab_below_data",
        ["model.vocab_size=100"],
        {},
        "model.vocab_size=100 is not valid; valid: null (the data's) or an integer >= data.vocab_size=256",
    ),
    (
        "bf16_layer_name",
        ["precision.bf16_layers=[lm_haed]"],
        {},
        "precision.bf16_layers='lm_haed' is not valid; valid: names of layers or sites, e.g. lm_head",
    ),
    (
        "plus_key_nothing_reads",
        ["+trainer.max_steps=100"],
        {},
        "trainer.max_steps=100 is not a config key; did you mean trainer.steps?",
    ),
    (
        "binary_file",
        ["data=shakespeare", "data.files=[{tmp}/binary.txt]"],
        {},
        "is not valid; valid: readable UTF-8 text files (byte 0 is not UTF-8)",
    ),
    (
        "nul_file",
        ["data=shakespeare", "data.files=[{tmp}/nul.txt]"],
        {},
        "is not valid; valid: readable text files (it holds NUL bytes: binary?)",
    ),
    # settings that are well typed but cannot mean anything
    (
        "margin_underflow",
        ["precision.margin=19"],
        {},
        "precision.margin=19 is not valid; valid: an integer in [0, 18] for the E4M3 sites (the forward sites: "
        "activations and weights): from margin 19 on, the amax scales to 448 x 2^-19, below half E4M3's smallest "
        "subnormal (2^-9), and rounds to zero",
    ),
    (
        "site_margin_underflow",
        ["precision.margin=3", "precision.site_margin={{mlp.up.grad_output:30}}"],
        {},
        "precision.site_margin.mlp.up.grad_output=30 is not valid; valid: margins adding up to at most 32 at the "
        "E5M2 site layers.0.mlp.up.grad_output (here precision.margin=3 + site margins 30 = 33)",
    ),
    (
        "amax_spike_current",
        ["precision.recipe=current", "precision.amax_spike={{site:attn.core.output,step:1,k:4}}"],
        {},
        "precision.amax_spike={'site': 'attn.core.output', 'step': 1, 'k': 4} is not valid; valid: null under "
        "precision.recipe=current, or attention.recipe=delayed for the attention core's sites (only "
        "delayed scaling keeps an amax history to hold a spike)",
    ),
    (
        "amax_spike_bf16",
        ["precision=bf16", "precision.amax_spike={{site:attn.core.output,step:1,k:4}}"],
        {},
        "precision.amax_spike='{site:attn.core.output,step:1,k:4}' is not a key of precision=bf16; it is one of "
        "precision=fp8",
    ),
    (
        "amax_spike_unknown",
        ["precision.amax_spike={{site:attn.kore.output,step:1,k:4}}"],
        {},
        "precision.amax_spike.site='attn.kore.output' is not valid; valid: site patterns (globs) matching "
        "attn.qkv.input",
    ),
    (
        "amax_spike_bf16_site",
        ["precision.amax_spike={{site:lm_head.input,step:1,k:4}}"],
        {},
        "precision.amax_spike.site='lm_head.input' is not valid; valid: site patterns (globs) matching FP8 sites",
    ),
    (
        "amax_spike_step",
        ["precision.amax_spike={{site:attn.core.output,step:2,k:4}}"],
        {},
        "precision.amax_spike.step=2 is not valid; valid: an integer in [1, 1]: a spike at step t lowers the scale "
        "from step t + 1 on, and trainer.steps=2",
    ),
    ("amax_spike_k", ["precision.amax_spike={{site:attn.core.output,step:1,k:0}}"], {}, "amax_spike.k=0 is not valid"),
    (
        "empty_files",
        ["data=shakespeare", "data.files=[]"],
        {},
        "data.files=[] is not valid; valid: null (the embedded texts) or a non-empty list",
    ),
    # raised inside run(), after Hydra made the run directory: removed again
    (
        "seq_len_over_validation",
        ["data.n_tokens=400"],
        {},
        "model.seq_len=32 is not valid; valid: at most 19: a sequence takes seq_len + 1 tokens, and the data "
        "holds 380 training and 20 validation tokens",
    ),
    (
        "probe_params_nothing",
        ["probe.params=[*.atn.*]"],
        {},
        "probe.params='*.atn.*' is not valid; valid: globs over whole parameter names, e.g. embedding, "
        "layers.*.attn.qkv.weight,",
    ),
    (
        "world_size",
        [],
        {"WORLD_SIZE": "3"},
        "model.global_batch=4 is not valid; valid: a positive multiple of trainer.micro_batch x world size = 2 x 3 = 6",
    ),
]
if NO_CUDA:
    CASES += [
        ("cuda_device", ["trainer.device=cuda"], {}, "trainer.device='cuda' is not valid; valid: auto, cpu"),
        ("te_backend", ["backend=te"], {}, "backend='te' is not valid; valid: "),
    ]
# Runs that already exist in {run}: the error must leave them as they were.
EXISTING = [
    (
        "resume_false",
        ["trainer.resume=false"],
        {},
        "trainer.resume=False is not valid; valid: true to continue the run",
    ),
    (
        "resume_other_model",
        ["trainer.resume=true", "model.d_model=64"],
        {},
        "model.d_model=64 is not valid; valid: 32, the value",
    ),
    (
        "resume_other_recipe",
        ["trainer.resume=true", "precision.amax_history_len=16"],
        {},
        "precision.amax_history_len=16 is not valid; valid: 1024, the value",
    ),
    (
        "resume_other_policy",
        ["trainer.resume=true", "policy=fresh_reround", "trainer.steps=3"],
        {},
        "policy='fresh_reround' is not valid; valid: 'exact', the value",
    ),
    ("resume_written_by_another", ["trainer.resume=true"], {"LOCK": "1"}, "Slurm job 99 holds it (lock touched"),
    ("resume_corrupt", ["trainer.resume=true"], {"CORRUPT": "1"}, "none of the 2 in"),
    (
        "resume_malicious",
        ["trainer.resume=true"],
        {"TAMPER": "malicious"},
        "was refused unread (Trying to load unsupported GLOBAL posix.mkdir",
    ),
    ("resume_old_format", ["trainer.resume=true"], {"TAMPER": "format"}, "valid: a checkpoint of format 3;"),
    ("resume_world_size", ["trainer.resume=true"], {"WORLD_SIZE": "3"}, "x world size = 2 x 3 = 6"),
]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for key in ("WORLD_SIZE", "SLURM_RESTART_COUNT", "HYDRA_FULL_ERROR"):
        env.pop(key, None)
    env.update({k: v for k, v in extra.items() if k not in ("CORRUPT", "TAMPER", "LOCK")})
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *TINY, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )


class _Mkdir:
    """Pickles as a call of ``os.mkdir(path)``: what a crafted checkpoint could run on load."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _tamper(run_dir: Path, how: str, marker: Path) -> None:
    """The newest checkpoint of ``run_dir`` with a pickled call inside, or an old format number,
    rewritten with its checksums (a crafted checkpoint is no damaged one: it must be refused)."""
    path = list_checkpoints(run_dir / "checkpoints")[-1][1]
    state = checkpoint_io.read(path)
    shared = checkpoint_io.unpack(state["shared"], path)
    if how == "malicious":
        shared["progress"]["note"] = _Mkdir(marker)
    else:
        shared["format"] = 1
    state["shared"] = checkpoint_io.pack(shared)
    checkpoint_io.save(state, path, distributed=False)


def _cut_token_shard(tmp: Path) -> None:
    """``{tmp}/small.txt`` tokenised into ``{tmp}/cache``, its token ids then cut short."""
    (tmp / "small.txt").write_text("".join(f"line {i} of a small text, word {i % 7}\n" for i in range(400)))
    data = load_data_cfg("shakespeare", files=[str(tmp / "small.txt")], vocab_size=300, block_lines=20)
    build_data(dataclasses.replace(data, cache_dir=str(tmp / "cache")), Layout(seq_len=32, micro_batch=2, seed=0))
    (shard,) = (tmp / "cache").glob("text/*/tokens-b20.bin")
    shard.write_bytes(shard.read_bytes()[:-64])


def _snapshot(run_dir: Path) -> dict[str, str]:
    """Hash of every file of a run directory but Hydra's log (which records each attempt)."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != "train.log"
    }


def _assert_one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in proc.stdout


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    proc = _run([f"hydra.run.dir={run_dir}"], _env({}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [1, 2]
    return run_dir


def test_bad_input_table(tmp_path, existing_run):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n \t\n\n")
    _cut_token_shard(tmp_path)
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x01" * 64)
    (tmp_path / "nul.txt").write_bytes(b"a text with a NUL\x00 byte\n")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(existing_run, corrupt)
    for _, path in list_checkpoints(corrupt / "checkpoints"):
        for part in path.iterdir():
            part.write_bytes(part.read_bytes()[:200])  # truncated, as by a full disk

    def one(index_case):
        index, (name, args, env, expected) = index_case
        args = [a.format(tmp=tmp_path) for a in args]
        if (name, args, env, expected) in EXISTING:
            run_dir = corrupt if env.get("CORRUPT") else tmp_path / f"existing_{name}"
            if not env.get("CORRUPT"):
                shutil.copytree(existing_run, run_dir)
            if env.get("TAMPER"):
                _tamper(run_dir, env["TAMPER"], tmp_path / "pwned")
            if env.get("LOCK"):  # a live process (this one) of another job writes the run
                lock = {**this_process(), "slurm_job": "99", "token": "live"}
                lock_path(run_dir).write_text(json.dumps(lock))
            before = _snapshot(run_dir)
            proc = _run([*args, f"hydra.run.dir={run_dir}"], _env(env))
            return name, proc, expected, run_dir, before
        run_dir = tmp_path / f"case_{index}"
        if not any(a.startswith("hydra.run.dir=") for a in args):
            args = [*args, f"hydra.run.dir={run_dir}"]
        return name, _run(args, _env(env)), expected, run_dir, None

    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(one, enumerate(CASES + EXISTING)))
    failures = []
    for name, proc, expected, run_dir, before in results:
        try:
            _assert_one_line(proc, expected)
            if before is None:
                assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
            else:
                assert _snapshot(run_dir) == before
        except AssertionError as e:
            failures.append(f"case {name}: {e}")
    assert not failures, "\n".join(failures)
    assert len(CASES + EXISTING) >= 20
    assert not Path("/proc/x").exists()
    assert not (tmp_path / "pwned").exists()  # the crafted checkpoint ran nothing


def test_full_error_shows_the_traceback_too(tmp_path):
    env = _env({"HYDRA_FULL_ERROR": "1"})
    pre_hydra = _run(["model.n_heads=3", f"hydra.run.dir={tmp_path / 'a'}"], env)
    in_run = _run([f"hydra.run.dir={tmp_path / 'b'}"], {**env, "WORLD_SIZE": "3"})
    for proc in (pre_hydra, in_run):
        assert proc.returncode == 2
        assert "Traceback" in proc.stderr and proc.stderr.splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="model=hf needs transformers")
def test_a_model_filter_naming_nothing_is_refused_in_one_line(tmp_path):
    """convert's ``filter`` as ``model=hf`` reaches it. Importing transformers may let other
    packages log warnings of their own on stderr, so the refusal is the one ``error:`` line."""
    run_dir = tmp_path / "run"
    proc = _run(["model=hf", "model.filter=[lm_haed]", f"hydra.run.dir={run_dir}"], _env({}))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert errors == [
        "error: model.filter='lm_haed' is not valid; valid: module-name patterns (globs or dotted prefixes) "
        "naming a module of the model, e.g. model.embed_tokens, model.layers.*.self_attn.q_proj, "
        "model.layers.*.self_attn.k_proj, model.layers.*.self_attn.v_proj, model.layers.*.self_attn.o_proj, "
        "model.layers.*.mlp.gate_proj, model.layers.*.mlp.up_proj, model.layers.*.mlp.down_proj, "
        "model.layers.*.input_layernorm, model.layers.*.post_attention_layernorm, model.norm, lm_head"
    ]
    assert not run_dir.exists()


def _no_permission(directory: Path) -> list[str]:
    """``directory`` made unwritable to this user: by its mode, or, for root (whom modes do not
    stop), by the immutable attribute; the command prefix to run under it."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return []
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)]).returncode != 0:
        pytest.skip("root ignores file modes, and chattr +i (ext4/xfs, CAP_LINUX_IMMUTABLE) is not available here")
    return []


def _read_only_fs(directory: Path) -> list[str]:
    """A command prefix that runs its command with ``directory`` bind-mounted read-only, in a
    mount namespace of its own (an unprivileged user namespace where the kernel allows one)."""
    prefix = ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(directory)]
    probe = subprocess.run([*prefix, "sh", "-c", f"! touch {directory}/probe 2>/dev/null"], capture_output=True)
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here (unshare -rm: {probe.stderr.decode().strip()[:200]})")
    return prefix


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_no_permission, "Operation not permitted" if os.geteuid() == 0 else "Permission denied"),
        (_read_only_fs, "Read-only file system"),
    ],
    ids=["no_permission", "read_only_fs"],
)
def test_a_run_directory_that_cannot_be_written_is_one_line(tmp_path, make, says):
    parent = tmp_path / "parent"
    parent.mkdir()
    try:
        prefix = make(parent)
        proc = subprocess.run(
            [*prefix, sys.executable, "train.py", *TINY, f"hydra.run.dir={parent / 'run'}"],
            cwd=REPO,
            env=_env({}),
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        if shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(parent)], capture_output=True)
        parent.chmod(0o755)
    _assert_one_line(proc, f"hydra.run.dir='{parent / 'run'}' is not valid; valid: a directory path you can write")
    assert says in proc.stderr, proc.stderr
    assert not (parent / "run").exists()
