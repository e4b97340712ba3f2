# Sourced by the batch script of a Slurm job (conf/hydra/launcher/slurm_apptainer.yaml): makes the
# job's `srun OPTIONS PYTHON ARGS...` line (written by submitit) run `python ARGS...` inside the
# Apptainer image $READBACK_IMAGE, with the GPUs (--nv) and the repository's src on PYTHONPATH,
# so the job runs the checkout it was launched from on the image's torch and Transformer Engine.
if [ ! -f "${READBACK_IMAGE:-}" ]; then
  echo "READBACK_IMAGE=${READBACK_IMAGE:-} is not an image file; build one: container/readback.def" >&2
  exit 2
fi
srun() {
  local options=()
  while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    case "$1" in
      --output|--error) options+=("$1" "$2"); shift 2 ;;
      *) options+=("$1"); shift ;;
    esac
  done
  shift  # the submitting machine's python: the image's own runs instead
  command srun "${options[@]}" apptainer exec --nv "$READBACK_IMAGE" \
    env PYTHONPATH="$READBACK_SRC" python "$@"  # not the host's PYTHONPATH: its packages are not the image's
}
