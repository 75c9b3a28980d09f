"""Framework adapters and the per-parameter state they keep.

* :mod:`.base` -- the flow shared by both frameworks, from Horovod's
  ``compress`` call to a transport and back;
* :mod:`.torch_adapter`, :mod:`.tf_adapter` -- each framework's collectives,
  state storage and checkpoints;
* :mod:`.param_state` -- ``ParamState``, the typed state of one parameter;
* :mod:`.tf_traces` -- TensorFlow state that survives retracing.
"""
