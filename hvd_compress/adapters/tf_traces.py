"""TF compressor state that survives every trace: how it is keyed, where it is
made, and who owns it when the compressor itself is rebuilt by a retrace.

Horovod traces ``compress`` inside ``tf.function``s (its own cached allreduce
function, and the user's step), so the Python that finds a key and makes state
runs once per trace, and a function is traced more than once: TF traces a
first call that creates variables twice, a new Python argument or input
signature retraces, and Horovod's allreduce function is cached per
compression object and optimizer name, so a second optimizer or tape with the
same compressor retraces it with other variables.

* **Keys** follow the ``tf.Variable`` object, not its position in the list
  Horovod reduces (:class:`VariableKeys`).
* **State** is made once per key, by
  :func:`hvd_compress.backend.tf_backend.state_variable`, outside TF's
  rule against variables made after a function's first call.
* **Compressors built inside the traced step** (Horovod's own TF2 examples)
  hand their calls to the first one so built (:func:`owner_across_traces`).
"""
from __future__ import annotations

import weakref

import tensorflow as tf

from ..backend.tf_backend import state_variable  # noqa: F401  (made outside every trace; re-exported)
from ..integration import horovod_internals


#: compressors built inside traced functions, by (type, configuration
#: fingerprint, process set id, ids of the variables reduced): the first
#: such compressor of each, which owns the state
_OWNERS_ACROSS_TRACES: dict = {}


def owner_across_traces(comp, tensor):
    """The compressor that owns the state of ``comp``, a compressor built
    while a ``tf.function`` was being traced: the first compressor so built,
    of the same type and configuration, that reduces the same variables.

    A retrace (a new Python argument, a new input signature, and TF's
    second trace of a first call that created variables) runs the step's
    Python again and so builds a new compressor; it must continue the error
    feedback, step counters, PowerSGD's Q and Auto's plan of the previous
    trace's object.  What is shared is defined by what Horovod reduces: the
    *same* ``tf.Variable`` objects in the same process set, with an identical
    configuration.  Another model or another optimizer over other variables
    gets its own owner, and a model rebuilt after its old variables died gets
    fresh state (the entry goes with the variables).  Compressors built
    outside any traced function are never merged: one object, one state.
    """
    import horovod.tensorflow as hvd
    caller = horovod_internals.find_tf_caller(tensor)
    ps = caller.process_set if caller.process_set is not None else hvd.global_process_set
    variables = caller.variables or []
    scope = (type(comp).__qualname__, comp.fingerprint(), getattr(ps, "process_set_id", None),
             tuple(id(v) for v in variables))
    owner = _OWNERS_ACROSS_TRACES.get(scope)
    if owner is None:
        owner = _OWNERS_ACROSS_TRACES[scope] = comp
        for v in variables:  # ids are reused once objects die: forget the entry with them
            weakref.finalize(v, _OWNERS_ACROSS_TRACES.pop, scope, None)
    return owner


class VariableKeys:
    """The state key of each ``tf.Variable`` whose gradient a compressor has seen.

    A variable keeps the key it was given when first seen, whatever list it
    arrives in later: Horovod filters local variables (``register_local_var``,
    ``register_local_source``) out of the list before its allreduce, and one
    compressor may serve several optimizers and tapes.  Variables seen for the
    first time get, in list order, :func:`~hvd_compress.integration.horovod_internals.unique_keys` of the
    new ones' names (a name once in the list is its own key; every
    ``tf.Variable`` made without ``name=`` is ``Variable:0``, so repeats
    become ``name#k``), and where that key is taken already, ``name#k`` with
    the smallest free ``k``.  Every rank runs the same program, so it sees the
    same lists in the same order and gives the same keys.  A key is never
    given twice, not even after its variable died: when a garbage collection
    frees a variable can differ between ranks.
    """

    def __init__(self):
        self._by_id = {}  # id of a live tf.Variable -> its key
        self._given = set()

    def keys_for(self, variables):
        new = []
        for v in variables:
            if id(v) not in self._by_id and all(v is not w for w in new):
                new.append(v)
        for v, proposed in zip(new, horovod_internals.unique_keys([v.name for v in new])):
            key, k = proposed, 0
            while key in self._given:
                key, k = f"{v.name}#{k}", k + 1
            self._given.add(key)
            self._by_id[id(v)] = key
            weakref.finalize(v, self._by_id.pop, id(v), None)  # the id may be reused after
        return [self._by_id[id(v)] for v in variables]

    def key_of(self, variable):
        return self._by_id.get(id(variable))


#: every graph being traced when hvd_compress built ops into it, and the graphs
#: around it (a ``tf.function`` called inside another's trace has that one as
#: its ``outer_graph``): the traces that hold this world's rank and size
_GRAPHS_WITH_OUR_OPS = weakref.WeakSet()


def note_traced_graph():
    """Remember the graph now being traced, and the ones around it, as
    holding hvd_compress's ops (:func:`functions_holding_our_ops`)."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and getattr(graph, "outer_graph", None) is not None:
        _GRAPHS_WITH_OUR_OPS.add(graph)
        graph = graph.outer_graph


def functions_holding_our_ops():
    """Every live ``tf.function`` with a trace that holds hvd_compress's ops,
    the user's own included (found among the live objects: a module-level
    step is referenced by nothing hvd_compress can see)."""
    import gc

    from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function
    found = []
    for obj in gc.get_objects():
        cache = getattr(obj, "_function_cache", None) if isinstance(obj, Function) else None
        # the cache itself, not _list_all_concrete_functions(): a method's tf.function seen on its
        # class would trace to answer that
        if cache is not None and any(getattr(t, "graph", None) in _GRAPHS_WITH_OUR_OPS for t in cache.values()):
            found.append(obj)
    return found


def drop_traces(function):
    """Make ``function`` (a ``tf.function``) trace again at its next call;
    its variables stay (TF does not make them again on a retrace)."""
    cache = getattr(function, "_function_cache", None)
    if cache is None or not hasattr(cache, "clear"):
        raise RuntimeError("hvd_compress.elastic: tf.function keeps its traces elsewhere in this TensorFlow "
                           f"({tf.__version__}); a step traced before a membership change would keep the old "
                           "number of workers")
    cache.clear()
