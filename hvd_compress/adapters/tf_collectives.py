"""TensorFlow's side collectives: Horovod's TF collectives, ops of the traced
step under the names the transports give (``ignore_name_scope``: the same
name on every rank whatever scope the step runs in)."""
from __future__ import annotations

import tensorflow as tf

from .base import pair_swap_min_bytes


class TFCollectives:
    """Horovod's TF collectives (:class:`hvd_compress.protocols.Collectives`);
    a handle is the result itself."""
    #: one allgather per payload part: the graph keeps each part's own dtype
    packs_gathers = False

    def allgather(self, tensor, name, process_set):
        import horovod.tensorflow as hvd
        return hvd.allgather(tensor, name=recognised_by_horovod("HorovodAllgather", name), process_set=process_set,
                             ignore_name_scope=True)

    def allgather_fixed(self, tensor, name, process_set, rank, size):
        """Between 2 ranks, where ``HVDC_PAIR_SWAP_MIN_BYTES`` is set and the
        payload's static size is that large, it travels as a Sum reduce-scatter of
        a ``[2, n/4]`` int32 tensor whose row of the peer holds this rank's bytes
        and whose own row is zeros, as in torch
        (:meth:`hvd_compress.adapters.torch_collectives.TorchCollectives.allgather_fixed` says why)."""
        n, at_least = tensor.shape.num_elements(), pair_swap_min_bytes()
        if (size != 2 or at_least is None or n is None or tensor.shape.rank == 0 or tensor.dtype == tf.bool
                or n * tensor.dtype.size < at_least):
            return self.allgather(tensor, name, process_set)
        import horovod.tensorflow as hvd
        itemsize, nbytes = tensor.dtype.size, n * tensor.dtype.size
        flat = tf.reshape(tensor, [-1])
        mine = flat if tensor.dtype == tf.uint8 else tf.reshape(tf.bitcast(flat, tf.uint8), [-1])
        words = -(-nbytes // 4)
        mine_words = tf.bitcast(tf.reshape(tf.pad(mine, [[0, 4 * words - nbytes]]), [words, 4]), tf.int32)
        zeros = tf.zeros([words], tf.int32)
        rows = tf.stack([zeros, mine_words] if rank == 0 else [mine_words, zeros])
        received = hvd.reducescatter(rows, op=hvd.Sum, name=recognised_by_horovod("HorovodAllgather", name),
                                     process_set=process_set, ignore_name_scope=True)
        peer = tf.reshape(tf.bitcast(received, tf.uint8), [-1])[:nbytes]
        both = tf.concat([mine, peer] if rank == 0 else [peer, mine], 0)
        if tensor.dtype != tf.uint8:
            both = tf.bitcast(tf.reshape(both, [2 * n, itemsize]) if itemsize > 1 else both, tensor.dtype)
        return tf.reshape(both, [2 * tensor.shape[0]] + tensor.shape.as_list()[1:])

    def allreduce_sum(self, tensor, name, process_set):
        import horovod.tensorflow as hvd
        return hvd.allreduce(tensor, op=hvd.Sum, name=recognised_by_horovod("HorovodAllreduce", name),
                             process_set=process_set, ignore_name_scope=True)

    def alltoall(self, tensor, name, process_set):
        """Equal splits along the first dimension."""
        import horovod.tensorflow as hvd
        return hvd.alltoall(tensor, name=recognised_by_horovod("HorovodAllgather", name), process_set=process_set,
                            ignore_name_scope=True)

    def wait(self, handle):
        return handle

    def nbytes(self, tensor):
        n = tensor.shape.num_elements()
        if n is not None:
            return n * tensor.dtype.size
        return tf.cast(tf.size(tensor), tf.int64) * tensor.dtype.size

    def dynamic_length(self, tensor):
        """The element count of a 1-D tensor whose length is data-dependent."""
        return tf.size(tensor)


def recognised_by_horovod(marker, name):
    """The TF node name of one of hvd_compress's collectives in a traced step:
    ``marker/name``, ``marker`` being ``HorovodAllgather`` or ``HorovodAllreduce``.

    Horovod 0.28.1's TF ``hvd.elastic.run`` treats a failed step as a lost
    worker (restore, reset, go on) only when the error's text holds one of
    those words, and otherwise returns as if training had finished.  Inside a
    trace TF names the failing op by its node name: with the marker in it, a
    failure in hvd_compress's collectives is recognised by the
    ``hvd.elastic.run`` of Horovod's own scripts, decorated before
    ``register`` could replace it.  The collective's name among the ranks
    stays ``name``: Horovod takes the part after the last ``/`` under
    ``ignore_name_scope=True``."""
    return f"{marker}/{name}"
