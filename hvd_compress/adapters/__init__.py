"""Framework adapters and the per-parameter state they keep.

* :mod:`.base` -- the flow shared by both frameworks, from Horovod's
  ``compress`` call to a transport and back, and when second rounds start;
* :mod:`.torch_adapter`, :mod:`.tf_adapter` -- each framework's caller, its
  roles composed, the elastic hooks;
* :mod:`.torch_collectives`, :mod:`.tf_collectives` -- each framework's side
  collectives;
* :mod:`.torch_store`, :mod:`.tf_store` -- each framework's per-parameter
  state store and checkpoints;
* :mod:`.param_state` -- ``ParamState``, the typed state of one parameter;
* :mod:`.tf_traces` -- TensorFlow state that survives retracing.
"""
