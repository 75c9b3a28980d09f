"""Framework codecs over the fused CPU kernels (:mod:`hvd_compress.kernels`).

A codec encodes one scheme's payload, with error feedback, in one or two
passes into per-parameter workspaces, and decodes into the gradient; the
transports use one where the adapter's codec provider returns it, else the
scheme's eager code runs (the reference the codecs are held to, bit for bit).

* :mod:`.torch_base` -- the PyTorch codec base and its workspace buffers;
* :mod:`.torch_fused` -- the PyTorch CPU codecs of the casts, Int8, the sign
  family, QSGD and TernGrad (``codec_for``);
* :mod:`.torch_sparse` -- Top-K, Threshold and DGC for PyTorch;
* :mod:`.torch_lowrank` -- PowerSGD's rounds in preallocated buffers;
* :mod:`.tf_fused` -- the TensorFlow CPU codecs, graph ops of the TF op
  library, which update the residual variable in place.
"""
