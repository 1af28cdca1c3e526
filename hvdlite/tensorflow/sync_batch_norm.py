"""SyncBatchNormalization: Keras batch normalization over the batch of every rank."""
import keras
import tensorflow as tf

from hvdlite.tensorflow import mpi_ops


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """A ``keras.layers.BatchNormalization`` whose training statistics are those of the
    concatenated batch of all ranks (ranks may have different batch sizes).

    Each rank's sum, sum of squares and element count go in one grouped allreduce
    (Sum); mean and variance follow from the totals, so the output, the moving
    statistics and (through the allreduce's gradient) the input gradient equal those of
    one BatchNormalization over the whole batch. Inference uses the moving statistics,
    as the base layer does. Every rank must call it in training at the same steps.
    """

    def _moments(self, inputs, mask):
        if mask is not None:
            raise NotImplementedError("SyncBatchNormalization does not take a mask")
        axes = list(self._reduction_axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        total, squares, count = mpi_ops.grouped_allreduce(
            [tf.reduce_sum(inputs, axes), tf.reduce_sum(tf.square(inputs), axes), count],
            op=mpi_ops.Sum)
        mean = total / count
        # E[x^2] - E[x]^2, clipped at 0 against rounding.
        return mean, tf.maximum(squares / count - tf.square(mean), 0.0)
