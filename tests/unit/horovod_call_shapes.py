"""The calls through which Horovod 0.28.1 reaches ``Compression.compress``,
statement for statement where they hand the gradient on, with the collectives
and TensorFlow ops left out (``tf.cond(cond, allreduce_fn, id_fn)`` becomes
``allreduce_fn()``).  Sources: horovod/torch/optimizer.py
(``_allreduce_grad_async``, ``_grouped_allreduce_grad_async``),
horovod/tensorflow/__init__.py (``allreduce``, ``grouped_allreduce``,
``_allreduce_cond``, ``_grouped_allreduce_cond``,
``_make_cached_allreduce_grads_fn``) and horovod/_keras/__init__.py
(``_allreduce``).

tests/unit/test_horovod_internals.py loads this file under the module name
``horovod.tensorflow`` (what :func:`hvd_compress.integration.horovod_internals.find_tf_caller`
matches frames by), so the frame readers see the very frames that this
Python makes for Horovod's comprehensions: a frame of their own up to 3.11,
inlined into the function's frame from 3.12 on (PEP 709).
"""


def split_list(items, n):  # horovod/common/util.py
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


# --- horovod/torch/optimizer.py ---------------------------------------------------------
class TorchDistributedOptimizer:
    def __init__(self, named_parameters, compression, process_set):
        self._parameter_names = {v: k for k, v in sorted(named_parameters)}
        self._compression = compression
        self.process_set = process_set

    def _allreduce_grad_async(self, p):
        name = self._parameter_names.get(p)  # noqa: F841 - as in Horovod
        tensor = p.grad
        tensor_compressed, ctx = self._compression.compress(tensor)
        return tensor_compressed, ctx

    def _grouped_allreduce_grad_async(self, ps):
        name = self._parameter_names.get(ps[0])  # noqa: F841 - as in Horovod
        tensors_compressed, ctxs = zip(*[self._compression.compress(p.grad) for p in ps])
        return tensors_compressed, ctxs


# --- horovod/tensorflow/__init__.py -----------------------------------------------------
def allreduce(tensor, compression=None, process_set=None, name=None, ignore_name_scope=False):
    tensor_compressed, ctx = compression.compress(tensor)
    return tensor_compressed


def grouped_allreduce(tensors, compression=None, process_set=None, name=None, ignore_name_scope=False):
    tensor_list = []
    for tensor in tensors:
        tensor_list.append(tensor)
    tensors_compressed, ctxs = zip(*[compression.compress(tensor) for tensor in tensor_list])
    return list(tensors_compressed)


def _allreduce_cond(tensor, *args, process_set=None, **kwargs):
    def allreduce_fn():
        return allreduce(tensor, *args, process_set=process_set, **kwargs)
    return allreduce_fn()


def _grouped_allreduce_cond(tensors, *args, process_set=None, **kwargs):
    def allreduce_fn():
        return grouped_allreduce(tensors, *args, process_set=process_set, **kwargs)
    return allreduce_fn()


def make_allreduce_grads_fn(compression, groups, process_set):
    """``_make_cached_allreduce_grads_fn``'s ``allreduce_grads``."""
    def allreduce_grads(grads, vars=None, use_generic_names=False):
        if groups is not None:
            if isinstance(groups, list):
                var_name2grad = {}
                for i in range(len(vars)):
                    var = vars[i]
                    grad = grads[i]
                    if grad is not None:
                        var_name2grad[var.name] = (i, grad)
                grads_split = []
                for group in groups:
                    grad_group = []
                    for var in group:
                        if var.name in var_name2grad:
                            grad_group.append(var_name2grad[var.name])
                            del var_name2grad[var.name]
                    grads_split.append(grad_group)
                for _, grad in var_name2grad.items():
                    grads_split.append([grad])
            elif groups > 0:
                grads_clean = [(i, grad) for i, grad in enumerate(grads) if grad is not None]
                grads_split = split_list(grads_clean, groups)

            reduce_ops = [None] * len(vars)
            for i, group in enumerate(grads_split):
                index_group, grad_group = [list(t) for t in zip(*group)]
                reduce_ops_group = _grouped_allreduce_cond(grad_group,
                                                           compression=compression,
                                                           process_set=process_set,
                                                           name=f"grad_{i}" if use_generic_names else None,
                                                           ignore_name_scope=use_generic_names)
                for i in range(len(index_group)):
                    reduce_ops[index_group[i]] = reduce_ops_group[i]
            return reduce_ops

        return [_allreduce_cond(grad,
                                compression=compression,
                                process_set=process_set,
                                name=f"grad_{i}" if use_generic_names else None,
                                ignore_name_scope=use_generic_names)
                if grad is not None else grad
                for i, grad in enumerate(grads)]
    return allreduce_grads


# --- horovod/_keras/__init__.py -----------------------------------------------------------
class KerasDistributedOptimizer:
    def __init__(self, allreduce_grads):
        self._allreduce_grads = allreduce_grads

    def _allreduce(self, grads, vars):
        return self._allreduce_grads(grads, vars)
