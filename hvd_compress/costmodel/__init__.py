"""The cost model, shared by ``Auto``, ``hvd-compress advise`` and the projection.

* :mod:`.model` -- a tensor's cost per transport (link, codec, the
  collective's CPU work, waits for a core) and a step's (fusion);
* :mod:`.step_plan` -- the step's plan by that model: a candidate per tensor,
  the rounds a step shares charged once;
* :mod:`.machine` -- which ranks share a machine and how many cores they have.
"""
