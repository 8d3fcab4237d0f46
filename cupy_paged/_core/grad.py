"""What the package says about autograd: it computes the forward pass only."""
from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_warned = False


def warn_no_grad() -> None:
    """Warn once a process that a torch input wants gradients (``requires_grad`` with grad mode on;
    called only for such an input, so torch is imported): the package computes the forward pass
    only, its outputs are detached and nothing flows back through attention.  The call goes on
    (inference without ``torch.no_grad()`` is common and correct); training through it is what the
    warning keeps from being silent.  The warning points at the first frame outside the package."""
    global _warned
    if _warned or not sys.modules["torch"].is_grad_enabled():
        return
    _warned = True
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn("cupy_paged computes attention's forward pass only: a torch input requires grad, but the "
                  "output is detached and no gradient flows back through it (run under torch.no_grad() or "
                  "torch.inference_mode(), or detach the inputs, to say that is intended)", UserWarning,
                  stacklevel=level)
