"""The TensorFlow backend (eager tensors, or symbolic ones inside the
``tf.function`` that Horovod always traces)."""
from __future__ import annotations

import functools
import queue
import threading

from .common import DTYPES, sampled_topk_plan


class TensorFlowBackend:
    name = "tensorflow"

    def __init__(self):
        import tensorflow as tf
        self.tf = tf
        self._dt = {n: getattr(tf, n) for n in DTYPES}
        _exclude_from_autograph()

    def dtype_name(self, x):
        return x.dtype.name

    def is_floating(self, x):
        return x.dtype.is_floating

    def shape(self, x):
        return tuple(x.shape.as_list())

    def numel(self, x):
        n = x.shape.num_elements()
        if n is None:
            raise ValueError(
                f"hvd_compress needs gradients with a static shape in TensorFlow; got {x.shape} "
                f"for {getattr(x, 'name', '?')}")
        return n

    def cast(self, x, dtype):
        return self.tf.cast(x, self._dt[dtype])

    def bitcast(self, x, dtype):
        return self.tf.bitcast(x, self._dt[dtype])

    def flatten(self, x):
        return self.tf.reshape(x, [-1])

    def reshape(self, x, shape):
        return self.tf.reshape(x, shape)

    def zeros(self, n, dtype, like=None):
        return self.tf.zeros([n], dtype=self._dt[dtype])

    def ones(self, n, dtype, like=None):
        return self.tf.ones([n], dtype=self._dt[dtype])

    def full(self, n, value, dtype, like=None):
        return self.tf.fill([n], self.tf.constant(value, dtype=self._dt[dtype]))

    def arange(self, n, dtype, like=None):
        return self.tf.range(n, dtype=self._dt[dtype])

    def scalar(self, value, dtype, like=None):
        return self.tf.reshape(self.tf.cast(value, self._dt[dtype]), [1])

    def concat(self, xs):
        return self.tf.concat(list(xs), 0)

    def stack(self, xs):
        return self.tf.stack(list(xs))

    def sum_in_order(self, xs):
        """``((xs[0] + xs[1]) + xs[2]) + ...`` as one reduction over a stacked axis.

        Why not a chain of adds: Grappler's arithmetic optimizer may rewrite such
        a chain into one AddN whose input order varies from process to process
        (measured: 1 to 3 fresh processes in 10 summed three tensors in another
        order; none with that optimizer switched off), so ranks would round
        differently and TF replicas drift apart by an ulp.  A
        reduction over axis 0 of a stack is one op that nothing reorders, and
        it sums in index order (checked against the sequential sum in
        tests/unit/test_backend.py)."""
        xs = list(xs)
        if len(xs) == 1:
            return xs[0]
        return self.tf.reduce_sum(self.tf.stack(xs), axis=0)

    def abs(self, x):
        return self.tf.abs(x)

    def sign(self, x):
        return self.tf.sign(x)

    def round(self, x):
        return self.tf.round(x)  # banker's rounding, like torch.round

    def floor(self, x):
        return self.tf.floor(x)

    def clip(self, x, lo, hi):
        return self.tf.clip_by_value(x, lo, hi)

    def round_clip(self, x, lo, hi):
        return self.tf.clip_by_value(self.tf.round(x), lo, hi)

    def abs_max(self, x, axis):
        return self.tf.reduce_max(self.tf.abs(x), axis=axis)

    def where(self, cond, a, b):
        return self.tf.where(cond, a, b)

    def maximum(self, a, b):
        return self.tf.maximum(a, b)

    def isfinite(self, x):
        return self.tf.math.is_finite(x)

    def copy(self, x):
        return self.tf.identity(x)

    def finite_or_zero(self, x):
        # as in torch: one read-only sum decides, and only a tensor with a
        # NaN/Inf is rewritten (tf.cond runs the branch it takes)
        if not self.tf.inside_function():
            return _finite_or_zero(self.tf, x)
        # In a trace, a tf.cond builds two branch functions for every tensor
        # (5 ms each; a model's step traces it for every gradient, twice where
        # it makes variables): one tf.function traced once for every length
        # calls the same cond in one op, which TF inlines when the graph runs.
        out = _finite_or_zero_function()(x)
        out.set_shape(x.shape)  # the function is traced for any length
        return out

    def shift_left(self, x, bits):
        return self.tf.bitwise.left_shift(x, self.tf.cast(bits, x.dtype))

    def shift_right(self, x, bits):
        return self.tf.bitwise.right_shift(x, self.tf.cast(bits, x.dtype))

    def bit_and(self, x, y):
        return self.tf.bitwise.bitwise_and(x, self.tf.cast(y, x.dtype))

    def sum(self, x, axis=None):
        return self.tf.reduce_sum(x, axis=axis)

    def max(self, x, axis=None):
        return self.tf.reduce_max(x, axis=axis)

    def norm(self, x):
        return self.tf.norm(x)

    def cumsum(self, x):
        return self.tf.cumsum(x)

    def count_nonzero(self, x):
        return self.tf.math.count_nonzero(x)

    def topk_indices(self, x, k):
        """Exact, by the same sampled-threshold shortcut as the torch backend
        (``tf.math.top_k`` over millions of elements is slower still); the
        fallback to the full top-k is a ``tf.cond``, so no host round trip."""
        tf = self.tf
        plan = None if x.shape[0] is None else sampled_topk_plan(x.shape[0], k)
        if plan is None:
            return tf.math.top_k(x, k=k, sorted=False).indices
        stride, want = plan
        thr = tf.reduce_min(tf.math.top_k(x[::stride], k=want, sorted=False).values)
        cand = tf.cast(tf.reshape(tf.where(x >= thr), [-1]), tf.int32)

        def among_candidates():
            return tf.gather(cand, tf.math.top_k(tf.gather(x, cand), k=k, sorted=False).indices)

        def full():
            return tf.math.top_k(x, k=k, sorted=False).indices

        return tf.cond(tf.size(cand) >= k, among_candidates, full)

    def gather(self, x, idx):
        return self.tf.gather(x, idx)

    def nonzero_indices(self, mask):
        return self.tf.reshape(self.tf.where(mask), [-1])

    def sort(self, x):
        return self.tf.sort(x)

    def searchsorted(self, sorted_seq, values):
        return self.tf.cast(self.tf.searchsorted(sorted_seq, values, side="left"), self.tf.int64)

    def kth_largest(self, x, k):
        return self.tf.math.top_k(x, k=k, sorted=True).values[k - 1]

    def scatter_add(self, n, idx, values):
        idx = self.tf.cast(self.tf.reshape(idx, [-1, 1]), self.tf.int64)
        return self.tf.scatter_nd(idx, values, self.tf.constant([n], dtype=self.tf.int64))

    def split(self, x, sizes, num):
        if isinstance(sizes, (list, tuple)):
            return self.tf.split(x, list(sizes), num=num)
        return self.tf.split(x, self.tf.reshape(self.tf.cast(sizes, self.tf.int64), [num]), num=num)

    def matmul(self, a, b):
        return self.tf.matmul(a, b)

    def transpose(self, a):
        return self.tf.transpose(a)

    def orthonormalize(self, m):
        return self.tf.linalg.qr(m).q

    def seed_for(self, base, step):
        """The seed of the draws of ``base`` (a Python int) at ``step`` (a
        tensor in the traced step): an int64 tensor."""
        import tensorflow as tf
        # the product of the two Python numbers is made here, not in the graph (it fits int64)
        return tf.constant((base % 1_000_000_007) * 1_000_003, tf.int64) + tf.cast(step, tf.int64)

    def uniform(self, n, seed, like=None):
        # stateless: the seed tensor (base seed, step) fully determines the draw
        seed = self.tf.cast(seed, self.tf.int64)
        pair = self.tf.stack([seed // 2**31, seed % 2**31])
        return self.tf.random.stateless_uniform([n], seed=pair, dtype=self.tf.float32)

    def randperm_prefix(self, n, k, seed, like=None):
        u = self.uniform(n, seed)
        return self.tf.sort(self.tf.math.top_k(u, k=k, sorted=False).indices)

    def identity_with_deps(self, x, deps):
        deps = [d for d in deps if d is not None]
        if not deps and isinstance(x, self.tf.Tensor):
            return x  # an Identity with nothing to wait for: one op less a tensor in a model's trace
        with self.tf.control_dependencies(deps):
            return self.tf.identity(x)

    def host_call(self, fn, x, out_dtype, out_len=None):
        out = self.tf.numpy_function(fn, [x], self._dt[out_dtype], stateful=False)
        return self.tf.reshape(out, [-1 if out_len is None else out_len])


def _finite_or_zero(tf, x):
    return tf.cond(tf.math.is_finite(tf.reduce_sum(x)), lambda: tf.identity(x),
                   lambda: tf.where(tf.math.is_finite(x), x, tf.zeros_like(x)))


@functools.lru_cache(maxsize=None)
def _finite_or_zero_function():
    """The ``tf.function`` of :meth:`TensorFlowBackend.finite_or_zero` in a trace,
    made once (``reduce_retracing``: after two lengths it takes any length)."""
    import tensorflow as tf
    return tf.function(lambda x: _finite_or_zero(tf, x), autograph=False, reduce_retracing=True)


def _exclude_from_autograph():
    """Horovod's TF code is converted by autograph, and it would convert ours
    too (every call below ``compress``): slow on every trace and pointless,
    since our code has no tensor-dependent Python control flow.  Autograph has
    no public per-module opt-out, so this adds a DoNotConvert rule for
    ``hvd_compress`` to its rule list; if that internal moves, conversion
    simply stays on."""
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:
        return
    if not any(isinstance(r, config_lib.DoNotConvert) and r._prefix == "hvd_compress"
               for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config_lib.DoNotConvert("hvd_compress"),) + tuple(config.CONVERSION_RULES)


class _VariableMaker:
    """One long-lived thread that makes :func:`state_variable`'s variables.

    A thread whose creator stack is empty is what lets compressor state be made
    while a step is traced; starting a thread for each variable cost about as
    much as the rest of a tensor's trace (a model's first trace makes four or
    five variables a tensor), so one thread serves them all, made at the first
    variable and waiting on a queue after."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._thread = None

    def make(self, fn):
        """``fn()`` run on the maker thread; its result, or its error raised here."""
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="hvd_compress-state", daemon=True)
                self._thread.start()
        done = queue.SimpleQueue()
        self._jobs.put((fn, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _serve(self):
        while True:
            fn, done = self._jobs.get()
            try:
                done.put((True, fn()))
            except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
                done.put((False, err))


_MAKER = _VariableMaker()


def state_variable(initial_value, dtype, name=None):
    """A non-trainable ``tf.Variable`` of compressor state, made outside any trace.

    ``compress`` runs while a ``tf.function`` traces.  TF refuses variables
    created by any but the first trace of a function ("tf.function only
    supports singleton tf.Variables created on the first call"), even under
    ``tf.init_scope()``: the refusal is a variable creator that the tracing
    function puts on the creator stack of the outer (eager) context too.
    That rule guards against a variable made anew at every trace; compressor
    state is made once per key and kept in the state store's dicts, as a
    variable made before the ``tf.function`` would be, so it is made here the
    same way: eagerly, on another thread (:class:`_VariableMaker`), whose
    creator stack is empty.  It is placed where ``tf.init_scope()`` would
    place it (the device scope around the step, if any)."""
    import tensorflow as tf
    device = None
    if dtype != tf.string and tf.config.list_logical_devices("GPU"):
        with tf.init_scope():
            device = tf.zeros([]).device

    def make():
        value = initial_value() if callable(initial_value) else initial_value
        if device is None:
            return tf.Variable(value, dtype=dtype, trainable=False, name=name)
        with tf.device(device):
            return tf.Variable(value, dtype=dtype, trainable=False, name=name)
    return _MAKER.make(make)
