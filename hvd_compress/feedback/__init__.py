"""Error-feedback support.

* :mod:`.memory` -- what error feedback keeps between steps: the plain
  residual, the momentum-aware memory, DGC's corrections;
* :mod:`.momentum_check` -- warnings for scheme / optimizer-momentum
  combinations measured not to train.
"""
