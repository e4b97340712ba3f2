"""One line: the Python, torch, CUDA, cuDNN, Triton and Transformer Engine versions and the GPU's capability.

Needs only torch: Transformer Engine's version is read from its package metadata (not imported)
by ``readback.backends.te.facts``, loaded from its file so that readback's other dependencies
need not be installed. Exits 1, with the line saying so, when torch cannot be imported.
"""

import importlib.metadata
import importlib.util
import platform
import sys
from pathlib import Path

FACTS = Path(__file__).resolve().parents[1] / "src" / "readback" / "backends" / "te" / "facts.py"
spec = importlib.util.spec_from_file_location("te_facts", FACTS)
facts = sys.modules["te_facts"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(facts)


def triton_version() -> str:
    """Triton's version from its package metadata (importing it is slow and may need a GPU)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


PYTHON = f"Python {platform.python_version()}"
try:
    import torch
except Exception as error:
    print(
        f"{PYTHON}, torch MISSING ({' '.join(str(error).split())[:120]}), Transformer Engine "
        f"{facts.installed_te_version() or 'MISSING'}"
    )
    sys.exit(1)

hw = facts.installed_hardware()
cudnn = facts.cudnn_version(torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
gpu = f"{torch.cuda.get_device_name()} {hw.describe().split(',')[0]}" if hw.capability else "none"
print(
    f"{PYTHON}, torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}, "
    f"cuDNN {'.'.join(map(str, cudnn)) if cudnn else 'none'}, Triton {triton_version()}, "
    f"Transformer Engine {facts.installed_te_version() or 'MISSING'}, GPU {gpu}"
)
