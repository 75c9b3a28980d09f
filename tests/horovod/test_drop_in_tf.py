"""Drop-in fidelity for the TF patterns people already have.

Runs under ``horovodrun -np 2`` with Gloo (scripts/run_tests.sh).

1. **Compressor built inside the traced step**, as Horovod's own TF2 examples
   do (``compression = ...`` inside ``@tf.function def benchmark_step(first_batch)``).
   The step retraces for ``first_batch=False`` and builds a second compressor;
   it must continue the first one's state.  The check: training with the
   compressor built inside gives *bit for bit* the weights of training with
   one compressor built outside, over steps on both sides of the retrace; and
   Top-K at ratio 1.0 built inside gives ``none``'s weights.  Two models whose
   variables have the same names and shapes, trained in turns, must not share
   state: each must match its own outside-built compressor.
2. **Variables with the same name** (``tf.Variable`` without ``name=`` is
   always ``Variable:0``) in every TF path: tape, legacy optimizer, Keras
   optimizer with ``backward_passes_per_step`` 1, 2 and 4 and
   ``sparse_as_dense``.  The check: renaming the variables apart must not
   change a single bit of the result, and the compressor keeps one residual
   per variable.
3. **Horovod's own Keras callbacks** in a ``model.fit`` with a compressor,
   after ``hvd_compress.integration.horovod_internals.use_tf_keras_in_horovod_callbacks()``
   (Horovod 0.28.1's callbacks bind Keras 3's backend otherwise):
   ``BroadcastGlobalVariablesCallback`` makes rank-specific starting weights
   equal, ``MetricAverageCallback`` reports the mean of the ranks' losses,
   ``LearningRateWarmupCallback`` and ``LearningRateScheduleCallback`` set the
   learning rate their formulas give, batch by batch.
4. **Local variables with gradient aggregation**: the Keras optimizer (current
   and legacy) with ``register_local_var`` and ``backward_passes_per_step``,
   and the tape with ``register_local_source``, one compressor through all of
   them, each step traced three times.  The check: against ``none``, local
   variables and tensors sent whole are equal, every other tensor differs by
   exactly what the ranks' residuals hold, and every variable has its own key.
5. **Auto() built inside the traced step**, in the tape step and in a Keras
   ``train_step`` under ``model.fit``, traced more than once: one plan, the
   replicas identical.

Every rank injects a rank-specific gradient ``w_r * v + b_r`` (the loss
``sum(w_r v^2 / 2 + b_r v)``), so error feedback carries real mass between steps.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvdk  # noqa: E402

import hvd_compress  # noqa: E402

hvd.init()
RANK = hvd.rank()

# scheme name -> how the compressor is built (PowerSGD needs a 2-D tensor: the shapes include one)
SCHEMES = {
    "TopK(0.3)": lambda: hvd_compress.TopK(0.3),
    "Int8": lambda: hvd_compress.Int8(),
    "PowerSGD(1)": lambda: hvd_compress.PowerSGD(1),
}
SHAPES = [(4, 6), (6,)]


def _variables(shapes, names=None, scale=1.0):
    """Deterministic starting values; ``names=None`` leaves TF's default name."""
    out = []
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape))
        init = (np.linspace(-1.0, 1.0, n) * (i + 1) * scale).reshape(shape).astype(np.float32)
        out.append(tf.Variable(init) if names is None else tf.Variable(init, name=names[i]))
    return out


def _loss(variables):
    total = 0.0
    for i, v in enumerate(variables):
        w = 0.5 + 0.25 * RANK + 0.1 * i
        b = tf.constant(np.sin(np.arange(int(np.prod(v.shape))) * (RANK + 1) + i).reshape(v.shape), tf.float32)
        total = total + tf.reduce_sum(0.5 * w * v * v + b * v)
    return total


def _train_tape(variables, build, inside, steps=4):
    """SGD through DistributedGradientTape in a tf.function with a Python
    ``first_batch`` argument (two traces), the compressor built inside or outside it."""
    opt = tf.keras.optimizers.SGD(0.1)
    outside = None if inside else build()

    @tf.function
    def step(first_batch):
        comp = build() if inside else outside
        with tf.GradientTape() as tape:
            loss = _loss(variables)
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        if first_batch:
            hvd.broadcast_variables(variables, root_rank=0)
        return loss

    for s in range(steps):
        step(s == 0)
    # first_batch=True, then False: at least two traces (TF traces a first call
    # that creates variables twice), each building its own compressor when inside
    assert step.experimental_get_tracing_count() >= 2
    return [v.numpy() for v in variables]


def _assert_same(got, want, exact=True):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# --- 1. compressor built inside the traced step -------------------------------------------
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_built_inside_step_continues_state_across_retrace(scheme):
    inside = _train_tape(_variables(SHAPES), SCHEMES[scheme], inside=True)
    outside = _train_tape(_variables(SHAPES), SCHEMES[scheme], inside=False)
    _assert_same(inside, outside)


def test_built_inside_step_topk_ratio_one_is_none():
    topk = _train_tape(_variables(SHAPES), lambda: hvd_compress.TopK(1.0), inside=True)
    dense = _train_tape(_variables(SHAPES), lambda: hvd_compress.none(), inside=True)
    _assert_same(topk, dense, exact=False)
    # and the test can tell: a lossy scheme moves the weights elsewhere
    lossy = _train_tape(_variables(SHAPES), lambda: hvd_compress.TopK(0.1), inside=True)
    assert not all(np.allclose(a, b, atol=1e-6) for a, b in zip(lossy, dense))


def test_models_with_equal_names_do_not_share_state():
    """Two models, variables named alike and shaped alike, each with its own
    traced step building TopK inside, trained in turns: each must match its
    own outside-built compressor (shared residuals would mix their gradients)."""
    def run(inside):
        models = [_variables(SHAPES, names=["w", "b"], scale=s) for s in (1.0, -2.0)]
        opts = [tf.keras.optimizers.SGD(0.1) for _ in models]
        outside = [hvd_compress.TopK(0.3) for _ in models]
        steps = []
        for m, (variables, opt) in enumerate(zip(models, opts)):
            def make(variables=variables, opt=opt, m=m):
                @tf.function
                def step(first_batch):
                    comp = hvd_compress.TopK(0.3) if inside else outside[m]
                    with tf.GradientTape() as tape:
                        loss = _loss(variables) * (m + 1)
                    grads = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, variables)
                    opt.apply_gradients(zip(grads, variables))
                    return loss
                return step
            steps.append(make())
        for s in range(4):
            for step in steps:
                step(s == 0)
        return [[v.numpy() for v in variables] for variables in models]

    got, want = run(inside=True), run(inside=False)
    for g, w in zip(got, want):
        _assert_same(g, w)


# --- 2. variables with the same name, every TF path -------------------------------------------
def _train_optimizer(variables, opt, steps):
    """``steps`` traced steps of Horovod's optimizer wrapper: gradients by its
    own method (Keras' ``_compute_gradients``, the legacy ``compute_gradients``)."""
    compute = opt._compute_gradients if hasattr(opt, "_compute_gradients") else opt.compute_gradients

    @tf.function
    def step():
        opt.apply_gradients(compute(lambda: _loss(variables), var_list=variables))

    for _ in range(steps):
        step()
    return [v.numpy() for v in variables]


def _train_keras(variables, comp, bpps, steps):
    return _train_optimizer(variables, hvdk.DistributedOptimizer(
        tf.keras.optimizers.SGD(0.1), backward_passes_per_step=bpps, sparse_as_dense=True, compression=comp), steps)


def _train_legacy(variables, comp, steps):
    return _train_optimizer(variables, hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), sparse_as_dense=True, compression=comp), steps)


PATHS = {
    "tape": lambda vs, comp: _train_tape(vs, lambda: comp, inside=False),
    "legacy": lambda vs, comp: _train_legacy(vs, comp, 4),
    "keras-bpps1": lambda vs, comp: _train_keras(vs, comp, 1, 4),
    "keras-bpps2": lambda vs, comp: _train_keras(vs, comp, 2, 4),
    "keras-bpps4": lambda vs, comp: _train_keras(vs, comp, 4, 8),
}


@pytest.mark.parametrize("shapes", [[(1,), (2,)], [(3,), (3,)]], ids=["shapes-differ", "shapes-equal"])
@pytest.mark.parametrize("path", list(PATHS))
def test_same_named_variables_keep_separate_state(path, shapes):
    unnamed = _variables(shapes)
    assert len({v.name for v in unnamed}) == 1, [v.name for v in unnamed]  # all 'Variable:0'
    comp = hvd_compress.TopK(0.5)
    got = PATHS[path](unnamed, comp)
    want = PATHS[path](_variables(shapes, names=[f"distinct_{i}" for i in range(len(shapes))]),
                       hvd_compress.TopK(0.5))
    _assert_same(got, want)  # names must not change a single bit
    residuals = [k for k in comp.state_dict()["tensorflow"] if k.startswith("residual/")]
    assert len(residuals) == len(shapes), residuals  # one residual per variable, none shared


@pytest.mark.parametrize("path", ["tape", "keras-bpps2"])
def test_same_named_variables_topk_ratio_one_is_none(path):
    got = PATHS[path](_variables([(2,), (3,)]), hvd_compress.TopK(1.0))
    want = PATHS[path](_variables([(2,), (3,)]), hvd_compress.none())
    _assert_same(got, want, exact=False)


# --- 3. Horovod's own Keras callbacks --------------------------------------------------------
class _LocalLoss(tf.keras.callbacks.Callback):
    """The epoch's loss as Keras computed it on this rank; placed before
    ``MetricAverageCallback``, which averages the logs in place."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


class _LearningRates(tf.keras.callbacks.Callback):
    """The learning rate each batch runs with; placed after the callbacks that set it."""

    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.lr.numpy()))


def test_horovod_keras_callbacks_in_model_fit():
    import tf_keras
    from horovod.tensorflow.keras import callbacks as hvd_callbacks

    from hvd_compress.integration.horovod_internals import TFKerasBackendForHorovod, use_tf_keras_in_horovod_callbacks

    use_tf_keras_in_horovod_callbacks()
    for module in (hvdk, hvd_callbacks):
        assert isinstance(module.K, TFKerasBackendForHorovod) and module.K.constant is tf_keras.backend.constant
    assert use_tf_keras_in_horovod_callbacks() is False  # idempotent

    size, steps, lr, epochs = hvd.size(), 4, 0.05, 4
    tf.keras.utils.set_random_seed(100 + RANK)  # different starting weights on every rank
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh", input_shape=(6,)),
                                 tf.keras.layers.Dense(1)])
    starts = hvd.allgather(tf.constant(np.concatenate([w.ravel() for w in model.get_weights()])[None])).numpy()
    assert not np.allclose(starts[0], starts[1])
    model.compile(loss="mse", optimizer=hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(lr),
                                                                  compression=hvd_compress.TopK(0.5)))
    rng = np.random.default_rng(RANK)  # rank-specific data: the local losses differ
    x = rng.normal(size=(steps * 8, 6)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 6) + RANK).astype(np.float32)[:, None]
    local, rates = _LocalLoss(), _LearningRates()
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[
        hvd_callbacks.BroadcastGlobalVariablesCallback(0),
        local,
        hvd_callbacks.MetricAverageCallback(),
        hvd_callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2, steps_per_epoch=steps),
        hvd_callbacks.LearningRateScheduleCallback(initial_lr=lr, multiplier=0.5, start_epoch=2),
        rates])

    ends = hvd.allgather(tf.constant(np.concatenate([w.ravel() for w in model.get_weights()])[None])).numpy()
    np.testing.assert_array_equal(ends[0], ends[1])  # one starting point, the same averaged updates
    losses = hvd.allgather(tf.constant([local.losses], tf.float64)).numpy()
    assert not np.allclose(losses[0], losses[1])
    np.testing.assert_allclose(history.history["loss"], losses.mean(axis=0), rtol=1e-5)
    want = []
    for epoch in range(epochs):
        for batch in range(steps):
            if epoch < 2:  # warmup over 2 epochs, per batch, from about lr/size up to lr
                e = epoch + batch / steps + 1 / steps
                want.append(lr / size * (e * (size - 1) / 2 + 1))
            else:  # staircase from epoch 2: lr * 0.5 ** (epoch - 2), set at each epoch's first batch
                want.append(lr * 0.5 ** (epoch - 2))
    np.testing.assert_allclose(rates.lrs, want, rtol=1e-6)


# --- 4. local variables with gradient aggregation, one compressor through every path ------------
# A compressor object is passed to several optimizers and tapes, each over its own unnamed
# variables, some of them registered as local: Horovod caches its traced allreduce function per
# compression object and optimizer name, so every Keras SGD (legacy or current) reaches the same
# traced function with a different variable list, and that function retraces.
LOCAL_SCHEMES = {
    "TopK(0.01)": lambda: hvd_compress.TopK(0.01),
    "PowerSGD(2)": lambda: hvd_compress.PowerSGD(2),
    "EFSignSGD": lambda: hvd_compress.EFSignSGD(),
    # decides after one communication; FP16 and Int8 left out to halve the branches each trace
    # builds (the tests of section 4 run Auto's every candidate)
    "Auto": lambda: hvd_compress.Auto(calibration_steps=1, probe_numels=(256, 4096), exclude=("FP16", "Int8")),
}
LOCAL_SHAPES = [(1,), (2,), (1,), (2,), (2,), (1,)]
LR, BPPS, LOCAL_STEPS = 0.5, 4, 8


def _linear_loss(variables):
    """A loss whose gradient does not depend on the weights: rank ``r``'s gradient of
    variable ``i`` is ``G[r, i]``, the same at every step, so the updates of any two
    runs can be compared element by element and their mass accounted for."""
    return tf.add_n([tf.reduce_sum(_constant_grad(i, v.shape) * v) for i, v in enumerate(variables)])


def _constant_grad(i, shape):
    n = int(np.prod(shape))
    return tf.constant((np.cos(np.arange(n) * 1.7 + i) * (1 + RANK) + 0.3 * i).reshape(shape), tf.float32)


def _local_pattern(path, comp, local, average):
    """Train fresh unnamed variables of LOCAL_SHAPES for LOCAL_STEPS steps along ``path``
    with ``local`` (indices) registered as local; the step takes a Python argument that
    changes at steps 0, 1 and 5, so it is traced at the first call (twice: it creates
    variables), again at the second, and again later."""
    variables = _variables(LOCAL_SHAPES)
    if path == "tape":
        opt = tf.keras.optimizers.SGD(LR)

        @tf.function
        def step(phase):
            with tf.GradientTape() as tape:
                loss = _linear_loss(variables)
            tape = hvd.DistributedGradientTape(tape, compression=comp)
            for i in local:
                tape.register_local_source(variables[i])
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    else:
        sgd = tf.keras.optimizers.legacy.SGD if path == "keras-legacy" else tf.keras.optimizers.SGD
        opt = hvdk.DistributedOptimizer(sgd(LR), backward_passes_per_step=BPPS, average_aggregated_gradients=average,
                                        sparse_as_dense=True, compression=comp)
        for i in local:
            opt.register_local_var(variables[i])

        @tf.function
        def step(phase):
            opt.apply_gradients(opt._compute_gradients(lambda: _linear_loss(variables), var_list=variables))

    for s in range(LOCAL_STEPS):
        step(0 if s == 0 else 1 if s < 5 else 2)
    assert step.experimental_get_tracing_count() >= 3
    return [v.numpy() for v in variables], variables


LOCAL_PATHS = [("keras", (1, 2), True), ("keras-legacy", (0, 3), False), ("tape", (4,), None)]
_DENSE_RUNS = {}  # (path, local, average) -> the weights ``none`` gives, computed once


def _dense_run(path, local, average):
    if (path, local, average) not in _DENSE_RUNS:
        _DENSE_RUNS[path, local, average] = _local_pattern(path, hvd.Compression.none, local, average)[0]
    return _DENSE_RUNS[path, local, average]


def _residual_of(comp, variable):
    """The error-feedback residual a compressor keeps for ``variable`` (zeros where none)."""
    key = comp.adapter_for("tensorflow").key_of(variable)
    residual = comp.state_dict()["tensorflow"].get(f"residual/{key}") if key is not None else None
    return np.zeros(variable.shape, np.float32) if residual is None else residual.reshape(variable.shape)


@pytest.mark.parametrize("scheme", list(LOCAL_SCHEMES))
def test_local_variables_with_aggregation_every_path(scheme):
    """One compressor through the Keras optimizer (current and legacy: both reach
    Horovod's one cached allreduce function for "DistributedSGD", with other
    variables and another subset of them local) with ``backward_passes_per_step``,
    and through the tape with a local source, each step traced three times.
    Against ``none`` run the same way: local variables and every tensor the
    scheme sends whole are equal; for every other tensor the difference is
    exactly what the ranks' residuals still hold.  Every variable that reached
    the allreduce has a key of its own."""
    comp = LOCAL_SCHEMES[scheme]()
    size = hvd.size()
    adapter = comp.adapter_for("tensorflow")
    keys = []
    for n, (path, local, average) in enumerate(LOCAL_PATHS):
        got, variables = _local_pattern(path, comp, local, average)
        keys += [adapter.key_of(v) for i, v in enumerate(variables) if i not in local]
        want = _dense_run(path, local, average)
        steps_per_update = BPPS if path != "tape" and average else 1
        for i, (g, w) in enumerate(zip(got, want)):
            label = f"{path} #{n} variable {i} {LOCAL_SHAPES[i]}"
            if i in local:
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=label)
                continue
            # sum over ranks of what was not sent = size * steps_per_update * (w_c - w_none) / lr
            held = hvd.allreduce(tf.constant(_residual_of(comp, variables[i])), op=hvd.Sum,
                                 name=f"test.local.{scheme}.{n}.{i}").numpy()
            np.testing.assert_allclose(size * steps_per_update * (g - w) / LR, held, rtol=1e-4, atol=1e-4,
                                       err_msg=label)
            exact = scheme == "PowerSGD(2)" or (scheme in ("TopK(0.01)", "EFSignSGD") and LOCAL_SHAPES[i] == (1,))
            if exact:
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=label)
    assert None not in keys and len(set(keys)) == len(keys), keys


# --- 5. Auto() built inside the traced step, traced more than once -----------------------------
def _replicas_identical(values, name):
    flat = tf.constant(np.concatenate([np.ravel(v) for v in values]), tf.float32)
    gathered = hvd.allgather(tf.reshape(flat, [1, -1]), name=name).numpy()
    return all(np.array_equal(gathered[0], row) for row in gathered)


def _assert_one_auto_state(built):
    """Every Auto a trace built sees the one plan the first one decided."""
    assert len(built) >= 2, len(built)
    plans = [auto.current_plan() for auto in built]
    assert plans[0] and all(p == plans[0] for p in plans), plans


def test_auto_built_inside_tape_step_across_retraces():
    """Horovod's synthetic-benchmark pattern with ``compression = hvd_compress.Auto()``
    inside the step: traced for ``first_batch=True`` (twice: variables are created),
    again for ``False``; past calibration, so the plan is decided in the traced step."""
    variables = _variables(LOCAL_SHAPES + [(16, 8)])
    opt = tf.keras.optimizers.SGD(LR)
    built = []

    @tf.function
    def step(first_batch):
        compression = hvd_compress.Auto(calibration_steps=2, probe_numels=(256, 4096))
        built.append(compression)
        with tf.GradientTape() as tape:
            loss = _linear_loss(variables)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        if first_batch:
            hvd.broadcast_variables(variables, root_rank=0)

    for s in range(6):
        step(s == 0)
    assert step.experimental_get_tracing_count() >= 2
    _assert_one_auto_state(built)
    assert _replicas_identical([v.numpy() for v in variables], "test.auto_inside.tape")


class _AutoInTrainStep(tf.keras.Model):
    """A Keras model whose ``train_step`` builds ``Auto()`` and Horovod's tape, as
    the synthetic benchmark builds them in its step; ``model.fit`` traces it."""

    def __init__(self):
        super().__init__()
        self.hidden = tf.keras.layers.Dense(8, activation="tanh")
        self.out = tf.keras.layers.Dense(1)
        self.built_autos = []

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        compression = hvd_compress.Auto(calibration_steps=2, probe_numels=(256, 4096))
        self.built_autos.append(compression)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_auto_built_inside_keras_train_step_across_retraces():
    """``model.fit`` with Auto built in ``train_step``: the train function is traced at
    the first call, then again when a second ``fit`` feeds batches of a static shape."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = (x @ rng.standard_normal((6, 1))).astype(np.float32)
    model = _AutoInTrainStep()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05))
    model(x[:1])
    hvd.broadcast_variables(model.variables, root_rank=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # a (None, 6) batch
    static = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)  # an (8, 6) batch
    model.fit(static, epochs=1, verbose=0)
    assert model.train_function.experimental_get_tracing_count() >= 2
    _assert_one_auto_state(model.built_autos)
    assert _replicas_identical(model.get_weights(), "test.auto_inside.keras")
