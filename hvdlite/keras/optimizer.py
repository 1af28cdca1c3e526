"""DistributedOptimizer for Keras 3: any Keras optimizer, gradients allreduced first.

``DistributedOptimizer(opt)`` returns an instance of a subclass of ``type(opt)`` made
from ``opt.get_config()`` (as Horovod does), so ``model.compile(optimizer=...)`` and
saving treat it as the original optimizer. Its ``apply`` (which ``apply_gradients``
and Keras' train step call) allreduces the gradients in one group before the update;
under Keras' compiled train step this runs as a graph node (see
``hvdlite.tensorflow.mpi_ops``), so compile with ``jit_compile=False`` on accelerators
(the default on CPU-only machines).

``backward_passes_per_step=N`` uses Keras' own gradient accumulation
(``gradient_accumulation_steps=N``): gradients are summed locally for N steps and
allreduced only on the update step, right before clipping (the hook is
``_clip_gradients``, which Keras calls exactly once per update).

Backends: TensorFlow through ``hvdlite.tensorflow``; PyTorch through
``hvdlite.torch`` (gradients reduced in place, by pointer). JAX is not supported: its
train step is a pure function traced by XLA, with no place for a host collective.
"""
import keras

from hvdlite import _checks, _names, process_sets, reducers
from hvdlite._enqueue import Average, Sum  # noqa: F401 (Horovod's names)
from hvdlite.keras.compression import Compression


def _allreduce_tensorflow(grads, settings, postscale):
    # hvdlite.tensorflow is imported when the tensorflow backend runs, never on the others.
    from hvdlite.tensorflow.gradients import allreduce_gradients

    if postscale != 1.0:
        grads = [g if g is None else g * postscale for g in grads]
    return allreduce_gradients(grads, settings["compression"], settings["op"],
                               settings["sparse_as_dense"],
                               settings["gradient_predivide_factor"],
                               process_set=settings["process_set"])


def _allreduce_torch(grads, settings, postscale):
    # hvdlite.torch is imported when the torch backend runs, never on the others.
    from hvdlite.torch import reduction

    compression = settings["compression"]
    psid = process_sets.process_set_id(settings["process_set"])
    present = [i for i, g in enumerate(grads) if g is not None]
    if reducers.is_reducer(compression):
        # A reducer averages: the optimizer's op and predivide factor do not apply.
        reducers.check_reducer(compression, Average, False, psid)
        values = [grads[i] * postscale if postscale != 1.0 else grads[i] for i in present]
        names, op, scale = [f"grad.{i}" for i in present], Average, (1.0, 1.0)
    else:
        values = [grads[i].contiguous() for i in present]
        # Named as an unnamed grouped_allreduce's members are: "<group>.<i>".
        group = _names.auto_name("grouped_allreduce", psid)
        names = [f"{group}.{i}" for i in range(len(present))]
        op, prescale, post = _checks.predivide_scaling(settings["op"],
                                                       settings["gradient_predivide_factor"])
        scale = (prescale, postscale * post)
    out = list(grads)
    if present:
        reduced = reduction.reduce_gradients(compression, values, names, op, scale,
                                             settings["process_set"])
        for i, g in zip(present, reduced):
            out[i] = g
    return out


_BACKENDS = {"tensorflow": _allreduce_tensorflow, "torch": _allreduce_torch}


def _allreduce_grads(grads, settings, postscale=1.0):
    backend = keras.backend.backend()
    reduce = _BACKENDS.get(backend)
    if reduce is None:
        raise NotImplementedError(
            f"hvdlite.keras.DistributedOptimizer supports the tensorflow and torch "
            f"backends, not {backend!r}")
    return reduce(list(grads), settings, postscale)


def _settings(compression=Compression.none, sparse_as_dense=False,
              gradient_predivide_factor=1.0, op=Average, average_aggregated_gradients=False,
              process_set=None):
    if op not in (Average, Sum):
        raise ValueError("DistributedOptimizer reduces gradients with op=Average or Sum")
    _checks.predivide_scaling(op, gradient_predivide_factor)  # refused here, not at a step
    process_set = process_sets.global_process_set if process_set is None else process_set
    process_sets.process_set_id(process_set)  # a set that is not registered: refused here
    return {"compression": compression, "sparse_as_dense": sparse_as_dense,
            "gradient_predivide_factor": gradient_predivide_factor, "op": op,
            "average_aggregated_gradients": average_aggregated_gradients,
            "process_set": process_set}


def distributed_class(base, settings=None):
    """Returns the subclass of optimizer class ``base`` that allreduces gradients.

    It keeps ``base``'s name and module, so a saved model names the original class;
    ``load_model`` maps those names back to these subclasses.
    """
    if getattr(base, "_hvdlite_settings", None) is not None:
        base = base._hvdlite_base

    class _DistributedOptimizer(base):
        _hvdlite_settings = dict(settings or _settings())
        _hvdlite_base = base

        def apply(self, grads, trainable_variables=None):
            if not self.gradient_accumulation_steps:
                grads = _allreduce_grads(grads, self._hvdlite_settings)
            return super().apply(grads, trainable_variables)

        def _clip_gradients(self, grads):
            # Called once per update, with the accumulated gradients, only where Keras
            # accumulates (gradient_accumulation_steps); apply() reduces otherwise.
            if self.gradient_accumulation_steps:
                steps = self.gradient_accumulation_steps
                # Keras averages over the steps; Horovod's default sums them.
                postscale = 1.0 if self._hvdlite_settings["average_aggregated_gradients"] \
                    else float(steps)
                grads = _allreduce_grads(grads, self._hvdlite_settings, postscale)
            return super()._clip_gradients(grads)

    _DistributedOptimizer.__name__ = base.__name__
    _DistributedOptimizer.__qualname__ = base.__qualname__
    _DistributedOptimizer.__module__ = base.__module__
    return _DistributedOptimizer


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None,
                         scale_local_gradients=True):
    """Wraps a Keras 3 optimizer so that it applies gradients averaged across ranks.

    Args:
        optimizer: any keras.optimizers.Optimizer (its config is copied; its state,
            if any, is not).
        name: a new name for the optimizer; None keeps the original's.
        device_dense, device_sparse: accepted for Horovod compatibility.
        compression: Compression.none or Compression.fp16 (this module's, or
            hvdlite.tensorflow's on the TensorFlow backend), or a reducer
            (Compression.topk/quantize/powersgd); a top-k left with momentum=None takes
            its momentum correction from a keras SGD's momentum (0 otherwise), one given
            a momentum must match it.
        sparse_as_dense: densify tf.IndexedSlices gradients (TensorFlow backend).
        gradient_predivide_factor: divide by this before the sum and by
            size()/factor after it.
        op: Average (default) or Sum.
        backward_passes_per_step: accumulate gradients locally for this many steps
            and communicate once per update.
        average_aggregated_gradients: with backward_passes_per_step > 1, average the
            accumulated gradients instead of summing them (Horovod's default sums).
        num_groups, groups, scale_local_gradients: accepted for Horovod compatibility
            (every gradient already goes in one group; no layer is local here).
        process_set: the ProcessSet whose members average the gradients (None: the
            global set); every member wraps its optimizer alike.

    Returns:
        An optimizer of a subclass of ``type(optimizer)``.

    Raises:
        ValueError: bad op, backward_passes_per_step < 1, or an optimizer that already
            accumulates gradients while backward_passes_per_step > 1.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, not "
                        f"{type(optimizer).__name__}")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    if hasattr(compression, "use_optimizer_momentum"):  # top-k's momentum correction
        if isinstance(optimizer, keras.optimizers.SGD):
            compression.use_optimizer_momentum(optimizer.momentum, not optimizer.nesterov)
        else:
            compression.use_optimizer_momentum(0.0)
    cls = distributed_class(type(optimizer), _settings(
        compression, sparse_as_dense, gradient_predivide_factor, op,
        average_aggregated_gradients, process_set))
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("the optimizer already sets gradient_accumulation_steps; "
                             "pass backward_passes_per_step only")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    if name is not None:
        config["name"] = name
    return cls.from_config(config)


def _builtin_optimizer_classes():
    base = keras.optimizers.Optimizer
    skip = {base, getattr(keras.optimizers, "LossScaleOptimizer", None)}
    return [c for c in vars(keras.optimizers).values()
            if isinstance(c, type) and issubclass(c, base) and c not in skip]


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """Loads a Keras model saved with a DistributedOptimizer, re-wrapping its optimizer.

    Args:
        filepath: the ``.keras`` file.
        custom_optimizers: optimizer classes of your own that the model may use.
        custom_objects: passed on to ``keras.models.load_model``.
        compression: the compression of the restored DistributedOptimizer.

    Returns:
        The model, compiled with a DistributedOptimizer holding the saved state.
    """
    settings = _settings(compression)
    objects = {cls.__name__: distributed_class(cls, settings)
               for cls in _builtin_optimizer_classes() + list(custom_optimizers or [])}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
