"""Which tensors autograd saves in one training step of any model, and what storing each as FP8
would cost the gradient (``python -m readback.cli.audit_model``).

    rows = audit_saved(model, lambda: loss_of(model, batch))
    print(to_markdown(rows))
"""

from readback.audit_model.core import FREE, STORAGES, AuditRow, audit_saved, stored
from readback.audit_model.examples import EXAMPLES, fog_loss
from readback.audit_model.report import to_markdown, write

__all__ = ["EXAMPLES", "FREE", "STORAGES", "AuditRow", "audit_saved", "fog_loss", "stored", "to_markdown", "write"]
