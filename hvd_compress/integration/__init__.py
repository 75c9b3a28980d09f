"""Horovod integration: everything that knows Horovod itself.

* :mod:`.horovod_internals` -- every read of Horovod's private frames and
  attributes (the parameter's key, process set, optimizer), and the Keras
  callbacks' backend rebinding;
* :mod:`.fingerprint` -- the once-per-compressor check that all ranks run the
  same configuration over the same parameters;
* :mod:`.elastic` -- elastic Horovod: residuals that follow ``commit`` /
  ``restore`` and membership changes (public as ``hvd_compress.elastic``);
* :mod:`.elastic_internals` -- what elastic TensorFlow needs of Horovod's
  internals.
"""
