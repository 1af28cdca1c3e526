"""Elastic states of variables: Keras models (any Keras 3 backend) and TensorFlow variables.

No framework is imported here: a variable is anything with ``numpy()`` and ``assign``
(``tf.Variable``, ``keras.Variable``). A commit holds every variable's value as a numpy
array (an exact copy of its bytes) and the other values, pickled; a restore assigns
them back, so weights and optimizer slots return bit for bit.
"""
import pickle

import numpy as np

from hvdlite.elastic.state import State


def _value(variable):
    # np.array copies: the commit must not change when the variable does.
    return np.array(variable.numpy(), order="C")


class VariablesState(State):
    """Groups of variables and other values, committed and restored together.

    Subclasses say which variables with ``_variable_groups()`` (an ordered dict: group
    name -> list of variables, in the same order on every rank).

    Args:
        **kwargs: the other values; each becomes an attribute that commits keep.
    """

    def __init__(self, **kwargs):
        super().__init__()
        self._keep_values(kwargs)

    def _variable_groups(self):
        raise NotImplementedError

    def _before_load(self, saved_groups):
        """Hook: prepares the variables to take ``saved_groups`` (e.g. builds them)."""

    def _serialize(self, f):
        groups = {name: [_value(v) for v in variables]
                  for name, variables in self._variable_groups().items()}
        values = {name: getattr(self, name) for name in self._value_names}
        pickle.dump({"groups": groups, "values": values}, f,
                    protocol=pickle.HIGHEST_PROTOCOL)

    def _deserialize(self, data):
        saved = pickle.loads(data)
        self._before_load(saved["groups"])
        for group, variables in self._variable_groups().items():
            values = saved["groups"].get(group, [])
            if len(values) != len(variables):
                raise ValueError(
                    f"hvdlite elastic: the committed state has {len(values)} {group} "
                    f"variable(s), this process has {len(variables)}: every rank must "
                    f"build the same model and optimizer")
            for variable, value in zip(variables, values):
                if tuple(variable.shape) != value.shape:
                    raise ValueError(
                        f"hvdlite elastic: {group} variable {variable.name!r} has shape "
                        f"{tuple(variable.shape)}, its committed value {value.shape}")
                variable.assign(value)
        for name, value in saved["values"].items():
            setattr(self, name, value)


def _optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class ModelState(VariablesState):
    """A Keras model, its optimizer and other values (``TensorFlowKerasState``).

    Commits hold every model variable (trainable and not) and every optimizer variable
    (its step count, learning rate and slots). An optimizer not built yet is built for
    the model's trainable variables here, so the first commit already holds its slots
    and a new world's fresh optimizer can take a commit's.

    Args:
        model: a built Keras model.
        optimizer: its optimizer; None takes ``model.optimizer`` (compile first).
        backend: accepted for Horovod compatibility (its TF1 sessions); unused.
        **kwargs: the other values (``epoch=0, batch=0`` for the Keras callbacks).

    Raises:
        ValueError: the model is not built, or there is no optimizer.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(**kwargs)
        if not getattr(model, "built", True):
            raise ValueError("hvdlite elastic: the model must be built before its state is "
                             "made (call model.build(input_shape) or the model once)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else \
            getattr(model, "optimizer", None)
        if self.optimizer is None:
            raise ValueError("hvdlite elastic: no optimizer: compile the model or pass "
                             "optimizer=")
        self._build_optimizer()
        self.save()

    def _build_optimizer(self):
        if not getattr(self.optimizer, "built", True) and hasattr(self.optimizer, "build"):
            self.optimizer.build(self.model.trainable_variables)

    def _variable_groups(self):
        return {"model": list(self.model.variables),
                "optimizer": _optimizer_variables(self.optimizer)}

    def _before_load(self, saved_groups):
        if saved_groups.get("optimizer"):
            self._build_optimizer()


class ListState(VariablesState):
    """A list of variables and other values (``TensorFlowState``).

    Args:
        variables: the variables, in the same order on every rank (eager: there is no
            TF1 global collection to default to).
        session: accepted for Horovod compatibility (TF1); unused.
        **kwargs: the other values.
    """

    def __init__(self, variables, session=None, **kwargs):
        super().__init__(**kwargs)
        self.variables = list(variables)
        self.save()

    def _variable_groups(self):
        return {"variables": self.variables}
